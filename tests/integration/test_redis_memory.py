"""Redis stays bounded (issue 14 point 4): 2,000 jobs, a drained writer, then the result TTL.

On a private redis-server (its memory is this test's alone): after the jobs
and the audit writer, ``{p}:audit`` and ``{p}:requests`` are empty, ``{p}:dead``
is within its bound although more entries than that were dead-lettered, and
once the result TTL has passed Redis's used memory is back within 10% of
where it started.

On both pool layouts: a private standalone redis-server, and a private 3-master
Redis Cluster (tests/support/redis_cluster.py) with the pool in 3 shards, whose
used memory is its masters' together; there every shard's streams are checked,
and each shard gets as many poison jobs as the standalone server does, so that
each shard's ``{p}:dead`` overflows its bound as the one standalone stream does.
"""

from __future__ import annotations

import time

import orjson
import pytest
from pool_layout import length
from redis_cluster import private_redis

from lorapool.audit_db import AuditWriter, DatabaseConfig, WriterConfig, create_audit_engine
from lorapool.audit_db.database import migrate
from lorapool.connection import connect
from lorapool.identity import model_identity
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LAYOUTS = ("standalone", "cluster")
JOBS, GARBAGE, DEAD_MAX_LEN, TTL_S = 2000, 300, 100, 3  # GARBAGE: per shard


@pytest.fixture
def server(layout, tmp_path):
    with private_redis(layout, tmp_path / "redis") as server:
        yield server


def used_memory(server) -> int:
    """The used memory of the server, or of every node of the cluster together."""
    total = 0
    for node in server.nodes:
        client = node.client()
        total += client.info("memory")["used_memory"]
        client.close()
    return total


def _run(conn, shards, engine, model, audit_db, jobs: int, garbage: int, tag: str, server):
    """Jobs and poison jobs through a worker, then the audit writer; returns the pool's
    keys and the used memory when the worker is done (the last TTL_S seconds' logs and
    markers still there)."""
    producer = Producer(conn, prefix="mem", shards=shards)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for first in range(0, jobs, 250):
        prompts = [f"job {i} of many" for i in range(first, min(jobs, first + 250))]
        producer.submit_many(prompts, params)
    for i in range(garbage):  # poison jobs: more dead letters than {p}:dead keeps
        data = orjson.dumps({"v": 1, "request_id": f"{tag}{i}"})
        conn.xadd(producer.keys.for_request(f"{tag}{i}").requests, {"data": data})
    config = WorkerConfig(
        prefix="mem",
        shards=producer.keys.shards,
        burst=True,
        result_ttl_s=TTL_S,
        dead_max_len=DEAD_MAX_LEN,
    )
    Worker(engine, conn, config, model_identity(model)).run()
    peak = used_memory(server)
    writer = WriterConfig(prefix="mem", shards=producer.keys.shards)
    stats = AuditWriter(conn, audit_db, writer).run(burst=True)
    assert stats.rows_written == jobs + garbage  # the poison jobs' errors are audited too
    return producer.keys, peak


def _wait_for_ttl(conn, shards) -> None:
    views = Keys("mem", shards).shard_views
    patterns = [view.out("*") for view in views] + [view.job("*") for view in views]
    deadline = time.monotonic() + TTL_S + 30
    while any(True for pattern in patterns for _ in conn.scan_iter(pattern, count=1000)):
        assert time.monotonic() < deadline, "chunk logs or job markers outlived the TTL"
        time.sleep(0.5)


def test_redis_memory_returns_after_result_ttl(server, model, tmp_path):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    conn = connect(server.url)
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=64))
    audit_db = create_audit_engine(DatabaseConfig(url=f"sqlite:///{tmp_path / 'audit.db'}"))
    migrate(audit_db)
    # A first round sizes what Redis keeps once per server (script cache, Lua heap,
    # streams and groups); the 2,000 jobs must leave nothing beyond it.
    _run(conn, server.shards, engine, model, audit_db, 200, 0, "warm", server)
    _wait_for_ttl(conn, server.shards)
    time.sleep(1)
    start = used_memory(server)
    garbage = GARBAGE * len(Keys("mem", server.shards).shard_views)
    keys, peak = _run(conn, server.shards, engine, model, audit_db, JOBS, garbage, "g", server)
    assert length(conn, keys, "audit") == 0 and length(conn, keys, "requests") == 0
    for view in keys.shard_views:
        assert DEAD_MAX_LEN <= conn.xlen(view.dead) <= DEAD_MAX_LEN + 100  # MAXLEN ~
    # the chunk logs and markers of the jobs finished in the worker's last TTL_S seconds
    # (~7 MB on a quiet machine) are there when it is done (measured then:
    # the writer's run, slow on a loaded machine, could outlast the TTL)
    assert peak > start + 1_000_000, (start, peak)
    _wait_for_ttl(conn, server.shards)
    for _ in range(40):  # Redis shrinks its key tables in its own cron, a moment later
        end = used_memory(server)
        if end <= start * 1.10:
            break
        time.sleep(0.25)
    assert end <= start * 1.10, (start, peak, end)
