"""A pool on a real 3-master Redis Cluster with 3 shards: keys, scripts, streams,
failover, dead letters and the audit trail, against the engine run in-process.

Needs ``$LORAPOOL_TEST_CLUSTER_URL`` (a node of the cluster ``.ci/redis-cluster``
starts); skipped without it. Every script runs under ``#!lua`` there, so a script
that touched a key of another slot than the keys it declared fails these tests.
"""

import asyncio
import os
import threading
import uuid

import orjson
import pytest
import redis
from redis.crc import key_slot

from lorapool.connection import connect, connect_async, register_script
from lorapool.lifecycle.keys import WORKERS_GROUP, Keys
from lorapool.producer import AsyncProducer, Producer
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.serve import base_model_info

pytestmark = pytest.mark.integration
SHARDS = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def cluster_url():
    url = os.environ.get("LORAPOOL_TEST_CLUSTER_URL")
    if not url:
        pytest.skip("no LORAPOOL_TEST_CLUSTER_URL (a Redis Cluster node; .ci/redis-cluster)")
    return url


@pytest.fixture
def cconn(cluster_url):
    connection = connect(cluster_url)
    assert isinstance(connection, redis.RedisCluster)
    yield connection
    connection.close()


@pytest.fixture
def keys(cconn):
    """A fresh sharded layout; every key of it is deleted after the test."""
    keys = Keys(f"test-{uuid.uuid4().hex[:10]}", SHARDS)
    yield keys
    for key in list(cconn.scan_iter(match=keys.pattern)):
        cconn.delete(key)


@pytest.fixture(scope="module")
def engine(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(
        EngineArgs(model=model, max_num_seqs=8, max_num_batched_tokens=512)
    )


def reference(engine, prompts, params=GREEDY):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"ref-{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"ref-{i}"] for i in range(len(prompts))]


def ids_on_every_shard(keys, count):
    """``count`` request ids whose shards go round 0, 1, 2, 0, ..."""
    candidates = (f"req-{i}" for i in range(10_000))
    ids = []
    for candidate in candidates:
        if len(ids) == count:
            break
        if keys.shard_of(candidate) == len(ids) % SHARDS:
            ids.append(candidate)
    return ids


def worker(engine, cconn, keys, model, **kw):
    config = WorkerConfig(
        prefix=keys.prefix, shards=SHARDS, burst=True, lease_s=1, insecure_no_key=True, **kw
    )
    return Worker(engine, cconn, config, base_model_info(model))


def nothing_pending(cconn, keys):
    return all(
        cconn.xpending(stream, WORKERS_GROUP)["pending"] == 0
        for view in keys.shard_views
        for stream in view.streams
    )


def test_keys_of_a_request_and_its_shard_share_a_slot():
    keys = Keys("pool", SHARDS)

    def slot(name: str) -> int:  # the slot the cluster puts a key in (redis-py's CRC16)
        return key_slot(name.encode())

    for rid in ("a", "b{c}", "x" * 300, "ünï\x00code"):
        view = keys.for_request(rid)
        names = [keys.job(rid), keys.out(rid), keys.abort(rid), keys.callback(rid)]
        names += [*view.streams, view.dead, view.audit, view.handoff("w1")]
        assert len({slot(name) for name in names}) == 1, names
    meta = [keys.adapters, keys.adapter_ids, keys.model, keys.workers, keys.alive("w")]
    assert len({slot(name) for name in meta}) == 1
    assert len({slot(view.requests) for view in keys.shard_views}) == SHARDS
    # unsharded names stay as they were
    assert Keys("pool").requests == "pool:requests"
    assert Keys("pool").out("r") == "pool:out:{r}"


def test_shebang_refuses_a_key_of_another_slot(cconn, keys):
    script = register_script(cconn, "return redis.call('GET', ARGV[1])")
    view = keys.on(0)
    assert script(keys=[view.requests], args=[view.dead]) is None  # same slot: fine
    with pytest.raises(redis.ResponseError, match="same slot|non local key"):
        script(keys=[view.requests], args=[keys.on(1).dead])


def test_pool_on_cluster_results_audit_and_nothing_pending(engine, cconn, keys, model, tmp_path):
    from lorapool.audit_db import AuditWriter, DatabaseConfig, WriterConfig, create_audit_engine
    from lorapool.audit_db.queries import get_request

    prompts = [f"hello {i} world" for i in range(9)]
    expected = reference(engine, prompts)
    producer = Producer(cconn, prefix=keys.prefix, shards=SHARDS)
    handles = producer.submit_many(
        prompts, GREEDY, request_ids=ids_on_every_shard(keys, len(prompts))
    )
    assert all(h.enqueued for h in handles)
    again = producer.submit("again", GREEDY, request_id=handles[0].request_id)
    assert again.enqueued is False
    worker(engine, cconn, keys, model).run()
    for handle, tokens in zip(handles, expected):
        assert handle.result(timeout=10).outputs[0].token_ids == tokens
    assert nothing_pending(cconn, keys)
    audit_lengths = [cconn.xlen(view.audit) for view in keys.shard_views]
    assert sum(audit_lengths) == len(prompts) and all(audit_lengths)

    db = create_audit_engine(DatabaseConfig(url=f"sqlite:///{tmp_path / 'audit.db'}"))
    config = WriterConfig(prefix=keys.prefix, shards=SHARDS, migrate=True, insecure_no_key=True)
    stats = AuditWriter(cconn, db, config).run(burst=True)
    assert stats.rows_written == len(prompts)
    for handle, tokens in zip(handles, expected):
        rows = get_request(db, handle.request_id, pool=keys.prefix)
        assert [row["token_ids"] for row in rows] == [tokens]
    assert sum(cconn.xlen(view.audit) for view in keys.shard_views) == 0


def test_async_streams_follow_shard_channels(engine, cconn, keys, model, cluster_url):
    prompts = [f"stream {i}" for i in range(6)]
    expected = reference(engine, prompts)
    delta = SamplingParams(temperature=0.0, max_tokens=8, output_kind="delta")

    async def main():
        producer = AsyncProducer(connect_async(cluster_url), prefix=keys.prefix, shards=SHARDS)
        handles = await producer.submit_many(
            prompts, delta, request_ids=ids_on_every_shard(keys, len(prompts))
        )
        thread = threading.Thread(target=worker(engine, cconn, keys, model).run)
        thread.start()

        async def tokens(handle):
            got = []
            async for out in handle.stream():
                got += out.outputs[0].token_ids
            return got

        try:
            return await asyncio.gather(*map(tokens, handles)), producer.follower.num_live
        finally:
            await asyncio.to_thread(thread.join)
            await producer.aclose()

    streams, live = asyncio.run(main())
    assert streams == expected
    assert live > 0  # chunks came over SSUBSCRIBE, not only from the logs


def test_entries_of_a_dead_worker_are_claimed_on_every_shard(engine, cconn, keys, model):
    prompts = [f"claimed {i}" for i in range(6)]
    expected = reference(engine, prompts)
    producer = Producer(cconn, prefix=keys.prefix, shards=SHARDS)
    handles = producer.submit_many(
        prompts, GREEDY, request_ids=ids_on_every_shard(keys, len(prompts))
    )
    taken = 0
    for view in keys.shard_views:  # a worker that read its entries, then died
        cconn.xgroup_create(view.requests, WORKERS_GROUP, id="0", mkstream=True)
        reply = cconn.xreadgroup(WORKERS_GROUP, "ghost", {view.requests: ">"}, count=10)
        taken += sum(len(got) for _, got in reply)
    assert taken == len(prompts)
    survivor = worker(engine, cconn, keys, model)
    survivor.ensure_group()
    deadline = 200
    while not all(h.status() == "finished" for h in handles) and deadline:
        survivor.run_once()
        deadline -= 1
    for handle, tokens in zip(handles, expected):
        assert handle.result(timeout=10).outputs[0].token_ids == tokens
    assert nothing_pending(cconn, keys)


def test_poison_entry_is_dead_lettered_on_its_shard(engine, cconn, keys, model):
    producer = Producer(cconn, prefix=keys.prefix, shards=SHARDS)
    good = producer.submit_many(
        ["fine one", "fine two", "fine three"], GREEDY, request_ids=ids_on_every_shard(keys, 3)
    )
    poison = keys.on(1)
    cconn.xadd(poison.requests, {"data": orjson.dumps({"v": 1, "request_id": 5, "x": "\x00"})})
    worker(engine, cconn, keys, model).run()
    assert all(h.result(timeout=10).outputs[0].finish_reason == "length" for h in good)
    dead = cconn.xrange(poison.dead)
    # two faults (an id of the wrong type, an unknown field): msgspec names the first it meets
    assert len(dead) == 1 and dead[0][1][b"reason"].startswith(b"request_id must be ")
    assert dead[0][1][b"reason"].endswith(b", got 5")
    assert [cconn.xlen(view.dead) for view in keys.shard_views] == [0, 1, 0]
    assert nothing_pending(cconn, keys)


def test_adapters_abort_and_identity_on_cluster(cconn, keys, model, tmp_path):
    from adapters import build_adapter

    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine
    from lorapool.protocol import LoRARequest

    args = EngineArgs(model=model, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8)
    lora_engine = LLMEngine.from_engine_args(args)
    path = build_adapter(model, tmp_path / "sql-lora", rank=8, seed=3)
    producer = Producer(cconn, prefix=keys.prefix, shards=SHARDS)
    producer.registry.add("sql-lora", path, adapter_id=7)  # WATCH/MULTI on the meta shard
    with pytest.raises(ValueError, match="already used by adapter 'sql-lora'"):
        producer.registry.add("other", path, adapter_id=7)
    prompts = ["with an adapter", "another one", "and a third"]
    lora = LoRARequest("sql-lora", 7, str(path))
    for i, prompt in enumerate(prompts):  # the oracle: the same engine, in-process
        lora_engine.add_request(f"ref-{i}", prompt, GREEDY, lora_request=lora if i == 0 else None)
    done = {}
    while lora_engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in lora_engine.step()})
    expected = [done[f"ref-{i}"] for i in range(len(prompts))]
    ids = ids_on_every_shard(keys, 4)
    adapter_job = producer.submit(prompts[0], GREEDY, "sql-lora", request_id=ids[0])
    base_jobs = producer.submit_many(prompts[1:], GREEDY, request_ids=ids[1:3])
    long = SamplingParams(max_tokens=300, ignore_eos=True)
    doomed = producer.submit("abort me", long, request_id=ids[3])
    work = worker(lora_engine, cconn, keys, model)
    work.ensure_group()
    for _ in range(3):
        work.run_once()
    doomed.abort()
    work.run()
    got = adapter_job.result(timeout=10)
    assert got.lora_request.name == "sql-lora" and got.lora_request.lora_int_id == 7
    assert [h.result(timeout=10).outputs[0].token_ids for h in [adapter_job, *base_jobs]] == (
        expected
    )
    assert doomed.result(timeout=10).outputs[0].finish_reason == "abort"
    assert nothing_pending(cconn, keys)
