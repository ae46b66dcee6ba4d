"""Worker and producer processes against real Redis.

The pool (2 workers, 2 producers, 4 adapters and the base model), kill -9,
SIGSTOP past the lease, and SIGTERM: drain on the first, hand back on the second;
on a standalone Redis and on a 3-master Redis Cluster (the pool in 3 shards).
"""

import os
import signal
import subprocess
import sys
import threading
import time

import orjson
import pytest
from gateway_procs import lorapool_cmd
from pool_layout import entries, length, pending

from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.protocol import SamplingParams
from lorapool.records.adapter import lora_from_record
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.serve import base_model_info

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
LONG = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(
        EngineArgs(model=model, max_num_seqs=16, enable_lora=True, max_loras=4, max_lora_rank=8)
    )


@pytest.fixture(scope="module")
def adapter_dirs(model, tmp_path_factory):
    from adapters import build_adapter

    root = tmp_path_factory.mktemp("pool-adapters")
    targets = [
        ("q_proj", "v_proj"),
        ("o_proj", "down_proj"),
        ("gate_proj", "up_proj"),
        ("k_proj", "v_proj"),
    ]
    return {
        f"ad{i}": build_adapter(model, root / f"ad{i}", rank=8, targets=t, seed=i, std=0.2)
        for i, t in enumerate(targets)
    }


def start_worker(pool_url, keys, model, tmp_path, *extra):
    cmd = lorapool_cmd(
        "worker",
        "--model",
        model,
        "--prefix",
        keys.prefix,
        "--shards",
        str(keys.shards),
        "--redis-url",
        pool_url,
        "--lease",
        "2",
        "--max-num-seqs",
        "8",
        "--enable-lora",
        "--max-loras",
        "4",
        "--max-lora-rank",
        "8",
        *extra,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # cwd outside the checkout: the repo root on sys.path would shadow packages
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.DEVNULL)


def reference(engine, prompts, params, loras=None):
    for i, p in enumerate(prompts):
        engine.add_request(f"ref-{i}", p, params, lora_request=loras[i] if loras else None)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"ref-{i}"].outputs[0] for i in range(len(prompts))]


PRODUCE = """
import sys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
url, prefix, shards = sys.argv[1], sys.argv[2], int(sys.argv[3])
first, step = int(sys.argv[4]), int(sys.argv[5])
names = [None if n == "base" else n for n in sys.argv[6].split(",")]
ids = range(first, 40, step)
Producer(url, prefix=prefix, shards=shards).submit_many(
    [f"prompt number {i} says" for i in ids], SamplingParams(temperature=0.0, max_tokens=16),
    lora_request=[names[i % len(names)] for i in ids], request_ids=[f"job-{i}" for i in ids])
"""
POOL = SamplingParams(temperature=0.0, max_tokens=16)
ASYNC_OUTPUT = "--async-output-proc"  # engine.async_output: outputs a step late
ASYNC_SCHEDULING = "--async-scheduling"  # engine.async_scheduling: a step in flight


def test_two_workers_two_producers(
    engine, conn, pool_url, keys, producer, model, adapter_dirs, tmp_path
):
    records = {n: producer.registry.add(n, d) for n, d in adapter_dirs.items()}
    names = ["base", *records]  # job i: names[i % 5]
    loras = [None if n == "base" else lora_from_record(records[n]) for n in names] * 8
    prompts = [f"prompt number {i} says" for i in range(40)]
    ids = [f"job-{i}" for i in range(40)]
    # one worker leaves a step in flight (async scheduling), one makes its outputs a step
    # late (async output processing); the synchronous engine is the reference's
    workers = [
        start_worker(pool_url, keys, model, tmp_path, flag)
        for flag in (ASYNC_SCHEDULING, ASYNC_OUTPUT)
    ]
    _wait_workers(conn, keys, 2)
    pool = [pool_url, keys.prefix, str(keys.shards)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PRODUCE, *pool, str(h), "2", ",".join(names)], cwd=tmp_path
        )
        for h in range(2)
    ]
    assert [p.wait(60) for p in procs] == [0, 0]
    expected = reference(engine, prompts, POOL, loras)
    base = reference(engine, prompts, POOL)
    results = [producer.handle(rid).result(timeout=90) for rid in ids]
    for w in workers:
        w.send_signal(signal.SIGTERM)
        assert w.wait(60) == 0
    for got, ref, lora in zip(results, expected, loras):
        assert got.outputs[0].token_ids == ref.token_ids and got.outputs[0].text == ref.text
        assert got.lora_request == lora and (lora is None or got.lora_request.name == lora.name)
    assert sum(e.token_ids != b.token_ids for e, b in zip(expected, base)) >= 16
    assert len({r.worker for r in results}) == 2
    assert length(conn, keys, "audit") == 40


def _wait_workers(conn, keys, count, timeout=90):
    deadline = time.monotonic() + timeout
    while conn.hlen(keys.workers) < count:
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.1)


def _logs(conn, producer, ids):
    return {rid: log_chunks(conn, producer.keys, rid) for rid in ids}


def _wait_partial(conn, producer, ids, at_least=5, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = _logs(conn, producer, ids)
        partial = [r for r, log in logs.items() if len(log) >= 2 and not log[-1].finished]
        if len(partial) >= at_least:
            return partial
        time.sleep(0.01)
    raise AssertionError("the worker never held enough running requests")


def _check_logs(conn, producer, ids, expected):
    for rid, ref in zip(ids, expected):
        log = _logs(conn, producer, [rid])[rid]
        assert [c.seq for c in log] == list(range(len(log)))
        offsets = [c.offset for c in log]
        sizes = [c.num_tokens for c in log]
        assert offsets == [sum(sizes[:i]) for i in range(len(log))]
        assert [c.finished for c in log] == [False] * (len(log) - 1) + [True]
        tokens = [t for c in log for o in c.outputs for t in o.token_ids]
        assert tokens == ref.token_ids
        text = "".join(o.text for c in log for o in c.outputs)
        assert text == ref.text


def _check_audited_once(conn, keys, ids):
    """One audit record per request id: a killed or fenced worker audits nothing twice."""
    audited = [orjson.loads(f[b"data"])["request_id"] for _, f in entries(conn, keys, "audit")]
    assert sorted(audited) == sorted(ids)


def _submit_long(producer, count=8):
    prompts = [f"long story {i}" for i in range(count)]
    handles = producer.submit_many(prompts, LONG)
    return prompts, [h.request_id for h in handles]


def test_kill_9_worker_loses_nothing(engine, conn, pool_url, keys, producer, model, tmp_path):
    prompts, ids = _submit_long(producer)
    first = start_worker(pool_url, keys, model, tmp_path, ASYNC_SCHEDULING)
    partial = _wait_partial(conn, producer, ids)
    first.send_signal(signal.SIGKILL)
    first.wait()
    second = start_worker(pool_url, keys, model, tmp_path, "--burst")
    expected = reference(engine, prompts, LONG)
    assert second.wait(120) == 0
    assert len(partial) >= 5
    _check_logs(conn, producer, ids, expected)
    _check_audited_once(conn, keys, ids)
    assert pending(conn, keys) == 0


def test_sigstop_past_lease_is_fenced(engine, conn, pool_url, keys, producer, model, tmp_path):
    prompts, ids = _submit_long(producer)
    paused = start_worker(pool_url, keys, model, tmp_path)
    _wait_partial(conn, producer, ids)
    paused.send_signal(signal.SIGSTOP)
    try:
        second = start_worker(pool_url, keys, model, tmp_path, "--burst")
        expected = reference(engine, prompts, LONG)
        assert second.wait(120) == 0
    finally:
        paused.send_signal(signal.SIGCONT)
    time.sleep(1.5)  # the woken worker tries to append and renew, and must be refused
    paused.send_signal(signal.SIGTERM)
    assert paused.wait(30) == 0
    _check_logs(conn, producer, ids, expected)
    _check_audited_once(conn, keys, ids)
    assert pending(conn, keys) == 0 and length(conn, keys, "dead") == 0


@pytest.mark.parametrize("flag", [ASYNC_OUTPUT, ASYNC_SCHEDULING])
def test_first_sigterm_drains(engine, conn, pool_url, keys, producer, model, tmp_path, flag):
    prompts, ids = _submit_long(producer)
    worker = start_worker(pool_url, keys, model, tmp_path, "--max-num-seqs", "4", flag)
    held = _wait_partial(conn, producer, ids, at_least=4)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    logs = _logs(conn, producer, ids)
    done = [rid for rid, log in logs.items() if log and log[-1].finished]
    assert sorted(done) == sorted(held)  # in-flight finished, nothing new was read
    for rid in done:
        assert sum(c.num_tokens for c in logs[rid]) == LONG.max_tokens
    assert all(not logs[rid] for rid in set(ids) - set(done))
    assert pending(conn, keys) == 0 and length(conn, keys, "requests") == len(ids) - 4


def _all_taken_by(conn, keys, name: str) -> bool:
    """Every entry pending in the workers' group is held by the worker ``name`` (its
    consumer: ``name#incarnation``)."""
    for view in keys.shard_views:
        consumers = conn.xpending(view.requests, WORKERS_GROUP)["consumers"]
        names = [(c["name"].decode().rsplit("#", 1)[0], c["pending"]) for c in consumers]
        if any(n != name and pending for n, pending in names):
            return False
    return True


def test_second_sigterm_hands_back(engine, conn, pool_url, keys, producer, model, tmp_path):
    prompts, ids = _submit_long(producer)
    expected = reference(engine, prompts, LONG)
    first = start_worker(pool_url, keys, model, tmp_path, "--lease", "60")
    _wait_partial(conn, producer, ids)
    first.send_signal(signal.SIGTERM)
    # the second before the first drain ends: a tiny model finishes 240 tokens in ~0.3 s
    time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0
    handed_back = time.monotonic()
    assert pending(conn, keys) == len(ids)
    config = WorkerConfig(
        prefix=keys.prefix, shards=keys.shards, lease_s=60, burst=True, name="second"
    )
    second = threading.Thread(target=Worker(engine, conn, config, base_model_info(model)).run)
    second.start()
    # claimed at once, not after the 60 s lease: the time to the claim, not to the end of
    # the run (on a loaded machine the run alone took over a minute)
    while not _all_taken_by(conn, keys, "second") and second.is_alive():
        time.sleep(0.05)
    claimed_after = time.monotonic() - handed_back
    second.join(300)
    assert not second.is_alive()
    assert claimed_after < 30
    _check_logs(conn, producer, ids, expected)
    assert pending(conn, keys) == 0
    assert {log_chunks(conn, producer.keys, r)[-1].worker for r in ids} == {"second"}
