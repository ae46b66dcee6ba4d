"""The queue path with an in-process worker: results, streams, bad input, abort, audit."""

import asyncio

import orjson
import pytest
from pool_layout import entries, length, pending

from lorapool.producer import AsyncProducer
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.records.audit import record_from_dict
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.serve import base_model_info

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = ["hello world", "the cat sat on", "one two three", "a b c d e"]


@pytest.fixture(scope="module")
def engine(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(
        EngineArgs(model=model, max_num_seqs=8, max_num_batched_tokens=512)
    )


def run_worker(engine, conn, keys, model, **kw):
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True, lease_s=2, **kw)
    worker = Worker(engine, conn, config, base_model_info(model))
    worker.run()
    return worker


def reference(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"ref-{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"ref-{i}"] for i in range(len(prompts))]


def test_results_equal_engine_and_audit(engine, conn, keys, producer, model):
    expected = reference(engine, PROMPTS, GREEDY)
    handles = producer.submit_many(PROMPTS, GREEDY, metadata={"user": "u1"})
    run_worker(engine, conn, keys, model)
    for handle, ref in zip(handles, expected):
        got = handle.result(timeout=5)
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        assert got.outputs[0].text == ref.outputs[0].text
        assert got.prompt_token_ids == ref.prompt_token_ids and got.worker
    records = [record_from_dict(orjson.loads(f[b"data"])) for _, f in entries(conn, keys, "audit")]
    assert sorted(r.request_id for r in records) == sorted(h.request_id for h in handles)
    assert all(r.metadata == {"user": "u1"} and r.adapter is None for r in records)
    assert pending(conn, keys) == 0


def test_idempotent_submit(engine, conn, keys, producer, model):
    first = producer.submit("hello", GREEDY, request_id="same")
    again = producer.submit("other prompt", GREEDY, request_id="same")
    assert first.enqueued and not again.enqueued
    assert length(conn, keys, "requests") == 1
    run_worker(engine, conn, keys, model)
    assert again.result(timeout=5).prompt == "hello"


def test_late_and_midway_streams(engine, conn, keys, producer, model):
    handle = producer.submit(
        "hello world", SamplingParams(temperature=0, max_tokens=10, output_kind="delta")
    )
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, lease_s=2)
    worker = Worker(engine, conn, config, base_model_info(model))
    worker.ensure_group()
    while conn.llen(producer.keys.out(handle.request_id)) < 4:
        worker.run_once()
    seen = [o for _, o in zip(range(3), handle.stream(timeout=5))]
    while handle.request_id in worker.held or engine.has_unfinished_requests():
        worker.run_once()
    rest = list(handle.stream(after=2, timeout=5))  # midway: what comes after seq 2
    late = list(handle.stream(timeout=5))  # after the end: everything
    assert [o.outputs[0].text for o in seen + rest] == [o.outputs[0].text for o in late]
    tokens = [t for o in late for t in o.outputs[0].token_ids]
    assert len(tokens) == 10 and late[-1].finished and rest
    cumulative = producer.handle(handle.request_id)
    cumulative.output_kind = "cumulative"
    assert list(cumulative.stream(timeout=5))[-1].outputs[0].token_ids == tokens


def _raw(conn, keys, data, request_id=None):
    """XADD ``data`` as a job, bypassing the producer: to ``request_id``'s shard (where a
    producer puts it), or with none (not even JSON) to the last shard."""
    view = keys.for_request(request_id) if request_id else keys.shard_views[-1]
    conn.xadd(view.requests, {"data": data})


def test_bad_input(engine, conn, keys, producer, model, tmp_path):
    adapter = tmp_path / "ad"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    producer.registry.add("sql", adapter, adapter_id=5)
    with pytest.raises(ValueError, match="already used by adapter 'sql'"):
        producer.registry.add("other", adapter, adapter_id=5)
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        producer.submit("hi", GREEDY, lora_request="nope")
    with pytest.raises(ValueError, match="colliding adapter id"):
        producer.submit("hi", GREEDY, lora_request=LoRARequest("sql", 6, str(adapter)))
    params = SamplingParams()
    params.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        producer.submit("hi", params)
    _raw(conn, keys, b"{not json")
    _raw(conn, keys, orjson.dumps({"v": 2, "request_id": "v2", "prompt": "x"}), "v2")
    lora = {"lora_name": "ghost", "lora_int_id": 9, "lora_path": "/g"}
    _raw(
        conn,
        keys,
        orjson.dumps({"v": 1, "request_id": "ghost", "prompt": "x", "lora_request": lora}),
        "ghost",
    )
    _raw(
        conn,
        keys,
        orjson.dumps(
            {"v": 1, "request_id": "badp", "prompt": "x", "sampling_params": {"temperature": -1}}
        ),
        "badp",
    )
    long = producer.submit({"prompt_token_ids": [5] * 600}, GREEDY)
    no_lora = producer.submit("hi", GREEDY, lora_request="sql")  # engine without LoRA
    good = producer.submit("hello world", GREEDY)
    run_worker(engine, conn, keys, model)
    assert good.result(timeout=5).outputs[0].finish_reason == "length"
    errors = {rid: producer.handle(rid).result(timeout=5) for rid in ("v2", "ghost", "badp")}
    assert "unknown wire version 2" in errors["v2"].error
    assert errors["ghost"].error.startswith("unknown adapter 'ghost'")  # no type name before
    assert errors["ghost"].lora_request.adapter_id == 9
    assert "temperature" in errors["badp"].error
    final = long.result(timeout=5)
    assert "600 tokens" in final.error and final.outputs[0].finish_reason == "error"
    refused = no_lora.result(timeout=5)
    assert "enable_lora" in refused.error and refused.lora_request.name == "sql"
    # each refusal's field, as a path, for readers to name the parameter (issue 50; no
    # reader reads it in the words); a wire version names none
    paths = [errors["ghost"], errors["badp"], final, refused, errors["v2"]]
    assert [o.error_field for o in paths] == [
        *("adapter", "sampling_params.temperature", "prompt", "adapter", None)
    ]
    reasons = sorted(f[b"reason"].decode() for _, f in entries(conn, keys, "dead"))
    expected = [
        "job badp: sampling_params.temperature must be a finite number >= 0.0, got -1",
        f"request {long.request_id}: the prompt has 600 tokens",
        "malformed job: not valid JSON",
        "unknown adapter 'ghost'",
        "unknown wire version 2",
        "enable_lora",
    ]
    assert len(reasons) == len(expected)
    for text in expected:  # one dead letter per bad job, each with its own reason
        assert sum(text in r for r in reasons) == 1, (text, reasons)
    records = {
        r.request_id: r
        for r in (
            record_from_dict(orjson.loads(f[b"data"])) for _, f in entries(conn, keys, "audit")
        )
    }
    failed = {"v2", "ghost", "badp", long.request_id, no_lora.request_id}
    assert set(records) == failed | {good.request_id}  # every request id, errors included
    for rid in failed:
        assert records[rid].outputs[0].finish_reason == "error" and records[rid].error
    assert "600 tokens" in records[long.request_id].error
    assert records[no_lora.request_id].adapter.name == "sql"
    assert records[long.request_id].metrics.num_prompt_tokens == 600
    assert pending(conn, keys) == 0


def test_abort(engine, conn, keys, producer, model):
    handle = producer.submit(
        "hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    )
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, lease_s=2)
    worker = Worker(engine, conn, config, base_model_info(model))
    worker.ensure_group()
    for _ in range(3):
        worker.run_once()
    handle.abort()
    # the abort lands a step or two later (the flag is seen with a chunk's round trip)
    for _ in range(50):
        if handle.request_id not in worker.held:
            break
        worker.run_once()
    final = handle.result(timeout=5)
    assert final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) < 10
    assert not worker.held and not engine.has_unfinished_requests()


def test_async_producer(engine, conn, keys, model, pool_url):
    async def submit():
        producer = AsyncProducer(pool_url, prefix=keys.prefix, shards=keys.shards)
        handles = await producer.submit_many(PROMPTS[:2], GREEDY)
        await producer.aclose()
        return [h.request_id for h in handles]

    ids = asyncio.run(submit())
    run_worker(engine, conn, keys, model)

    async def results():
        producer = AsyncProducer(pool_url, prefix=keys.prefix, shards=keys.shards)
        outs = [await (await producer.handle(rid)).result(timeout=5) for rid in ids]
        await producer.aclose()
        return outs

    assert all(o.finished and len(o.outputs[0].token_ids) == 12 for o in asyncio.run(results()))


def test_serve_quiets_the_collector(engine, conn, keys, producer, model, monkeypatch):
    """``serve`` (the ``lorapool worker`` process) runs the worker with the heap frozen
    and a higher first-generation threshold (``lorapool/heap.py``), and puts both back
    when it stops; results are unchanged."""
    import gc

    from lorapool import heap
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine
    from lorapool.worker.serve import serve

    expected = reference(engine, PROMPTS[:2], GREEDY)
    before, seen = gc.get_threshold(), []
    step = LLMEngine.step

    def recording_step(self):
        seen.append((gc.get_threshold()[0], gc.get_freeze_count()))
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", recording_step)
    handles = producer.submit_many(PROMPTS[:2], GREEDY)
    args = EngineArgs(model=model, max_num_seqs=8, max_num_batched_tokens=512)
    serve(args, WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True), conn)
    assert [h.result(timeout=5).outputs[0].token_ids for h in handles] == [
        r.outputs[0].token_ids for r in expected
    ]
    assert seen and all(t >= heap.GEN0_THRESHOLD and frozen > 1000 for t, frozen in seen)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_worker_waits_out_a_cluster_between_slot_maps(
    engine, conn, keys, producer, model, monkeypatch, caplog
):
    """SlotNotCoveredError (a cluster mid-resharding; not a RedisError) on the worker's
    APPEND is Redis away for a moment: the worker backs off, sends the trip again and
    goes on; every result is exact. (Injected once into the call: a real cluster shows
    it only while its slots move.)"""
    import redis

    from lorapool.worker.publisher import Publisher

    expected = reference(engine, PROMPTS[:2], GREEDY)
    real, calls = Publisher.append, []

    def fails_once(self, items):
        calls.append(len(items))
        if len(calls) == 2:  # after the first chunks landed: mid-stream
            raise redis.exceptions.SlotNotCoveredError("slot 1 is not covered")
        return real(self, items)

    monkeypatch.setattr(Publisher, "append", fails_once)
    handles = producer.submit_many(PROMPTS[:2], GREEDY)
    run_worker(engine, conn, keys, model)
    assert [h.result(timeout=5).outputs[0].token_ids for h in handles] == [
        r.outputs[0].token_ids for r in expected
    ]
    assert len(calls) > 2 and "slot 1 is not covered" in caplog.text
    assert pending(conn, keys) == 0
