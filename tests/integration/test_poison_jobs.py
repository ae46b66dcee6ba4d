"""Poison jobs fail alone: the worker goes on, the other jobs' tokens do not change.

Issue 14 point 1, against a real Redis: each poison job that crashed workers
is a named case (raw ``XADD`` of the wire record, as a hostile producer would),
an engine step that raises fails only the requests it held, and a worker
process is fed arbitrary JSON and mutations of valid jobs (hypothesis) next
to valid jobs. The oracle for the valid jobs is the same engine run without
the garbage.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import uuid

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from job_changes import changed
from json_strategies import json_values as any_json
from pool_layout import entries, ids_on_shard, length, pending

from lorapool.connection import connect
from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
from lorapool.records.audit import record_from_dict
from lorapool.records.chunk import encode_chunk
from lorapool.records.dead_letter import decode_dead_letter
from lorapool.records.job import job_from_dict
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.serve import base_model_info

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
GOOD_PROMPTS = ["hello world", "the cat sat on"]


@pytest.fixture(scope="module")
def engine(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(
        EngineArgs(model=model, max_num_seqs=8, max_num_batched_tokens=512)
    )


@pytest.fixture(scope="module")
def expected(engine):
    """The good prompts' tokens, run alone on the engine: the oracle."""
    for i, prompt in enumerate(GOOD_PROMPTS):
        engine.add_request(f"solo-{i}", prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[f"solo-{i}"].outputs[0].token_ids for i in range(len(GOOD_PROMPTS))]


def run_worker(engine, conn, keys, model) -> Worker:
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True, lease_s=2)
    worker = Worker(engine, conn, config, base_model_info(model))
    worker.run()
    return worker


def _job(rid: str, **changes) -> dict:
    job = {"v": 1, "prompt": "poison", "sampling_params": {"temperature": 0.0, "max_tokens": 4}}
    return changed({**job, "request_id": rid}, **changes)


# The poison jobs of issue 14 point 1, as raw XADDs: (job changes, what the reason names)
POISON = {
    "seed_string": ({"sp_seed": "abc"}, "sampling_params.seed must be an integer, got 'abc'"),
    "top_k_float": ({"sp_top_k": 2.5}, "sampling_params.top_k must be an integer, got 2.5"),
    "logprobs_float": ({"sp_logprobs": 2.5}, "sampling_params.logprobs must be an integer"),
    "stop_not_strings": ({"sp_stop": [1]}, r"sampling_params.stop\[0\] must be a non-empty"),
    "stop_token_ids_strings": ({"sp_stop_token_ids": ["a"]}, r"stop_token_ids\[0\]"),
    "seed_2_pow_70": ({"sp_seed": float(2**70)}, "sampling_params.seed must be an integer"),
    "arrival_time_list": ({"arrival_time": [1]}, "arrival_time must be a finite number"),
    "lora_name_list": (
        {"lora_request": {"lora_name": [1], "lora_int_id": 1}},
        "lora_request.lora_name must be a non-empty string",
    ),
    "logprobs_over_engine_limit": ({"sp_logprobs": 10**6}, "max_logprobs"),
    "token_outside_vocabulary": ({"prompt_token_ids": [10**6]}, "vocabulary"),
    "prompt_10_mb": ({"prompt": "x" * (10 << 20)}, "over the limit of 1048576"),
}


@pytest.mark.parametrize("case", sorted(POISON))
def test_poison_job_fails_alone(case, engine, expected, conn, keys, producer, model):
    changes, reason = POISON[case]
    before = producer.submit(GOOD_PROMPTS[0], GREEDY)
    poison = {"data": orjson.dumps(_job("poison", **changes))}
    stream = keys.for_request("poison").requests
    entry = conn.xadd(stream, poison).decode()  # where a producer puts it
    after = producer.submit(GOOD_PROMPTS[1], GREEDY)
    run_worker(engine, conn, keys, model)
    assert before.result(timeout=5).outputs[0].token_ids == expected[0]
    assert after.result(timeout=5).outputs[0].token_ids == expected[1]
    [(_, dead)] = entries(conn, keys, "dead")  # one dead letter, on any shard
    letter = decode_dead_letter(dead)
    assert (letter.source, letter.stream, letter.entry) == ("worker", stream, entry)
    assert letter.worker and re.search(reason, letter.reason)
    payload = _job("poison", **changes)
    assert orjson.loads(dead[b"data"]) == {  # the audit record keeps the prompt, not this
        "sha256": hashlib.sha256(orjson.dumps(payload)).hexdigest(),
        "bytes": len(orjson.dumps(payload)),
    }
    failed = producer.handle("poison").result(timeout=5)  # the client learns why
    assert failed.outputs[0].finish_reason == "error" and re.search(reason, failed.error)
    assert failed.error_kind == "request"  # readers route by it (a 400), not by the text
    audit = entries(conn, keys, "audit")
    logged = sum(len(encode_chunk(c)) for c in log_chunks(conn, keys, "poison"))
    kept = logged + sum(len(f[b"data"]) for _, f in audit)
    assert kept < 64 << 10  # an oversized prompt is not copied into the log or the audit
    audit = [record_from_dict(orjson.loads(f[b"data"])) for _, f in audit]
    assert {r.request_id for r in audit} == {before.request_id, after.request_id, "poison"}
    assert pending(conn, keys) == 0


def test_dead_letter_path_survives_an_unreadable_adapter_record(
    engine, conn, keys, producer, model
):
    """The issue's pool-down case: the dead-letter path itself must not raise."""
    conn.hset(keys.adapters, "ghost", b"\xff not a record")
    lora = {"lora_name": "ghost", "lora_int_id": 3}
    job = {"data": orjson.dumps(_job("g", lora_request=lora))}
    conn.xadd(keys.for_request("g").requests, job)
    no_id = {"data": b'{"v": 1, "request_id": {"a": 1}}'}  # no request id: any shard's
    conn.xadd(keys.shard_views[-1].requests, no_id)
    good = producer.submit(GOOD_PROMPTS[0], GREEDY)
    run_worker(engine, conn, keys, model)
    assert good.result(timeout=5).outputs[0].finish_reason == "length"
    assert length(conn, keys, "dead") == 2
    assert producer.handle("g").result(timeout=5).outputs[0].finish_reason == "error"
    assert pending(conn, keys) == 0


def test_engine_step_that_raises_fails_only_its_requests(model, conn, keys, producer, expected):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=2))
    execute, calls = engine.runner.execute, []

    def failing_third_step(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device-side assert triggered")
        return execute(batch)

    engine.runner.execute = failing_third_step
    # the victims on the shard a worker reads first, so that they are the two it holds
    victims = ids_on_shard(keys, 0, 2, "victim")
    held = producer.submit_many(["a victim", "another victim"], GREEDY, request_ids=victims)
    later = producer.submit_many(GOOD_PROMPTS, GREEDY)  # waits in Redis: max_num_seqs=2
    run_worker(engine, conn, keys, model)
    for handle in held:
        out = handle.result(timeout=5)
        assert out.outputs[0].finish_reason == "error"
        assert "engine step failed: RuntimeError: device-side assert" in out.error
        assert out.error_kind == "engine"
    assert [h.result(timeout=5).outputs[0].token_ids for h in later] == expected
    assert not engine.has_unfinished_requests()
    assert length(conn, keys, "audit") == 4
    assert pending(conn, keys) == 0


# --- a worker process fed arbitrary JSON next to valid jobs (hypothesis) --------------

json_values = any_json(text_size=12, width=3, leaves=8)
FIELDS = ["v", "request_id", "prompt", "prompt_token_ids", "sampling_params", "lora_request"]
FIELDS += ["metadata", "arrival_time", "extra"]
PARAMS = sorted(SamplingParams.__struct_fields__)


@st.composite
def garbage(draw) -> bytes:
    """Random JSON of any shape, or a valid job with fields replaced by random JSON."""
    if draw(st.booleans()):
        return orjson.dumps(draw(json_values))
    job = _job(f"g-{uuid.uuid4().hex[:8]}")
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()) and isinstance(job["sampling_params"], dict):
            job["sampling_params"][draw(st.sampled_from(PARAMS))] = draw(json_values)
        else:
            job[draw(st.sampled_from(FIELDS))] = draw(json_values)
    return orjson.dumps(job)


@pytest.fixture(scope="module")
def worker_processes(model, tmp_path_factory):
    """``start(pool_url, shards)``: the module's worker process of that layout, started
    at its first use, (process, its pool's keys, its log); each stopped, and its keys
    deleted, after the module."""
    started = {}

    def start(pool_url: str, shards: int):
        if pool_url not in started:
            keys = Keys(f"test-{uuid.uuid4().hex[:10]}", shards)
            log = tmp_path_factory.mktemp("poison") / "worker.log"
            cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", "worker"]
            cmd += ["--model", model, "--prefix", keys.prefix, "--shards", str(shards)]
            cmd += ["--redis-url", pool_url, "--lease", "5"]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, cwd=log.parent, env=env, stdout=out, stderr=out)
            started[pool_url] = (proc, keys, log)
        return started[pool_url]

    yield start
    for pool_url, (proc, keys, _) in started.items():
        proc.terminate()
        proc.wait(30)
        conn = connect(pool_url)
        for key in list(conn.scan_iter(match=keys.pattern)):
            conn.delete(key)
        conn.close()


@pytest.fixture
def worker_process(worker_processes, pool_url, shards):
    return worker_processes(pool_url, shards)


def add_garbage(conn, keys, position: int, payload: bytes) -> tuple[int, str]:
    """XADD of ``payload`` where a producer puts it: on its request id's shard, or, with
    no request id, on any (by ``position``); (the shard, the entry id)."""
    try:
        rid = orjson.loads(payload).get("request_id")
    except AttributeError:  # not an object
        rid = None
    shard = keys.shard_of(rid) if isinstance(rid, str) else position % len(keys.shard_views)
    return shard, conn.xadd(keys.on(shard).requests, {"data": payload}).decode()


# request ids each worker process (by key prefix) has seen end, across hypothesis's examples
_ENDED: dict[str, set] = {}


def _request_id(payload: bytes):
    try:
        rid = orjson.loads(payload).get("request_id")
    except (AttributeError, orjson.JSONDecodeError):
        return None
    return rid if isinstance(rid, str) else None


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(garbage(), min_size=1, max_size=6))
def test_worker_process_survives_arbitrary_records(worker_process, conn, expected, payloads):
    proc, keys, log = worker_process
    producer = Producer(conn, prefix=keys.prefix, shards=keys.shards)
    added = [add_garbage(conn, keys, i, p) for i, p in enumerate(payloads[:3])]
    good = producer.submit_many(GOOD_PROMPTS, GREEDY)
    added += [add_garbage(conn, keys, i, p) for i, p in enumerate(payloads[3:], 3)]
    results = [h.result(timeout=60).outputs[0].token_ids for h in good]
    assert results == expected
    deadline = time.monotonic() + 60
    while pending(conn, keys) or length(conn, keys, "requests"):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "garbage entries still pending"
        time.sleep(0.05)
    assert proc.poll() is None, log.read_text()[-3000:]
    dead = {
        (view.shard, f[b"entry"].decode()): f[b"reason"].decode()
        for view in keys.shard_views
        for _, f in conn.xrange(view.dead)
    }
    ended = _ENDED.setdefault(keys.prefix, set())  # ids this worker process already ended
    for entry, payload in zip(added, payloads):
        rid = _request_id(payload)  # None: no readable id, never a duplicate
        repeat = rid is not None and rid in ended
        ended.add(rid)
        if entry in dead:
            assert dead[entry]
            continue
        if repeat:  # a second entry of an id that ended: acked as a duplicate (issue 31
            continue  # Build 3), no second run and no second dead letter
        try:  # not dead-lettered: only a job the boundary accepts may complete
            rid = job_from_dict(orjson.loads(payload)).request_id
        except ValueError as exc:
            raise AssertionError(f"refused job {payload!r} was not dead-lettered: {exc}") from None
        final = log_chunks(conn, keys, rid)[-1]
        assert final.finished
