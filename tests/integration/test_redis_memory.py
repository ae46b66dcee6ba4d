"""Redis stays bounded (issue 14 point 4): 2,000 jobs, a drained writer, then the result TTL.

On a private redis-server (its memory is this test's alone): after the jobs
and the audit writer, ``{p}:audit`` and ``{p}:requests`` are empty, ``{p}:dead``
is within its bound although more entries than that were dead-lettered, and
once the result TTL has passed Redis's used memory is back within 10% of
where it started.
"""

from __future__ import annotations

import time

import orjson
import pytest
import redis
from redis_server import RedisServer

from lorapool.audit_db import AuditWriter, DatabaseConfig, WriterConfig, create_audit_engine
from lorapool.audit_db.database import migrate
from lorapool.identity import model_identity
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]
JOBS, GARBAGE, DEAD_MAX_LEN, TTL_S = 2000, 300, 100, 3


@pytest.fixture
def server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def used_memory(conn) -> int:
    return conn.info("memory")["used_memory"]


def _run(conn, engine, model, audit_db, jobs: int, garbage: int, tag: str):
    producer = Producer(conn, prefix="mem")
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for first in range(0, jobs, 250):
        prompts = [f"job {i} of many" for i in range(first, min(jobs, first + 250))]
        producer.submit_many(prompts, params)
    for i in range(garbage):  # poison jobs: more dead letters than {p}:dead keeps
        data = orjson.dumps({"v": 1, "request_id": f"{tag}{i}"})
        conn.xadd(producer.keys.requests, {"data": data})
    config = WorkerConfig(prefix="mem", burst=True, result_ttl_s=TTL_S, dead_max_len=DEAD_MAX_LEN)
    Worker(engine, conn, config, model_identity(model)).run()
    stats = AuditWriter(conn, audit_db, WriterConfig(prefix="mem")).run(burst=True)
    assert stats.rows_written == jobs + garbage  # the poison jobs' errors are audited too
    return producer.keys


def _wait_for_ttl(conn) -> None:
    deadline = time.monotonic() + TTL_S + 30
    while any(True for _ in conn.scan_iter("mem:out:*", count=1000)) or any(
        True for _ in conn.scan_iter("mem:job:*", count=1000)
    ):
        assert time.monotonic() < deadline, "chunk logs or job markers outlived the TTL"
        time.sleep(0.5)


def test_redis_memory_returns_after_result_ttl(server, model, tmp_path):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    conn = redis.Redis.from_url(server.url)
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=64))
    audit_db = create_audit_engine(DatabaseConfig(url=f"sqlite:///{tmp_path / 'audit.db'}"))
    migrate(audit_db)
    # A first round sizes what Redis keeps once per server (script cache, Lua heap,
    # streams and groups); the 2,000 jobs must leave nothing beyond it.
    _run(conn, engine, model, audit_db, 200, 0, "warm")
    _wait_for_ttl(conn)
    time.sleep(1)
    start = used_memory(conn)
    keys = _run(conn, engine, model, audit_db, JOBS, GARBAGE, "g")
    assert conn.xlen(keys.audit) == 0 and conn.xlen(keys.requests) == 0
    assert DEAD_MAX_LEN <= conn.xlen(keys.dead) <= DEAD_MAX_LEN + 100  # MAXLEN ~
    peak = used_memory(conn)
    assert peak > start + 1_000_000  # the chunk logs and markers are there until the TTL
    _wait_for_ttl(conn)
    for _ in range(40):  # Redis shrinks its key tables in its own cron, a moment later
        end = used_memory(conn)
        if end <= start * 1.10:
            break
        time.sleep(0.25)
    assert end <= start * 1.10, (start, peak, end)
