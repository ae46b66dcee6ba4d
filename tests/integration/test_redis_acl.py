"""The Redis ACL rules of docs/redis-acl.md, on a private redis-server.

The users are created from the document itself; a producer, a worker, the
audit writer and ``status`` then each run with their own user only, and each
user is refused what its role does not need.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import redis
from redis_server import RedisServer

from lorapool.audit_db import AuditWriter, DatabaseConfig, WriterConfig, create_audit_engine
from lorapool.audit_db.database import migrate
from lorapool.cli.queue_status import live_workers
from lorapool.connection import connect
from lorapool.identity import model_identity
from lorapool.pool_metrics import PoolCollector
from lorapool.producer import AsyncProducer, Producer
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
DOC = Path(__file__).resolve().parents[2] / "docs" / "redis-acl.md"
PASSWORD = "test-password-0123"


def acl_rules() -> dict[str, str]:
    """role -> its ACL SETUSER line, from the fenced ``acl ROLE`` blocks of the doc."""
    blocks = re.findall(r"```acl ([\w-]+)\n(ACL SETUSER [^\n]+)\n```", DOC.read_text())
    return {role: line.replace("CHANGE-ME", PASSWORD) for role, line in blocks}


@pytest.fixture
def server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    admin = redis.Redis(port=server.port)
    for line in acl_rules().values():
        admin.execute_command(*line.split())
    yield server
    server.stop()


def url(server, role: str) -> str:
    return f"redis://lorapool-{role}:{PASSWORD}@127.0.0.1:{server.port}/0"


def test_doc_has_the_three_roles():
    assert sorted(acl_rules()) == ["audit-writer", "producer", "worker"]


def test_each_role_runs_with_its_own_user(server, model, tmp_path):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    adapter = tmp_path / "ad"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    producer = Producer(url(server, "producer"))
    producer.registry.add("ad", adapter)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    handles = producer.submit_many(["hello", "world", "again"], params)
    handles[2].abort()
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=4))
    worker_conn = connect(url(server, "worker"))
    Worker(engine, worker_conn, WorkerConfig(burst=True), model_identity(model)).run()
    outputs = [h.result(timeout=5) for h in handles]
    assert [o.outputs[0].finish_reason for o in outputs[:2]] == ["length", "length"]
    audit_db = create_audit_engine(DatabaseConfig(url=f"sqlite:///{tmp_path / 'audit.db'}"))
    migrate(audit_db)
    writer_conn = connect(url(server, "audit-writer"))
    assert AuditWriter(writer_conn, audit_db, WriterConfig()).run(burst=True).rows_written == 3
    assert live_workers(producer.redis, producer.keys) == []  # status, as the producer

    async def follow(request_id):  # the async producer's follower: channel and log
        async_producer = AsyncProducer(url(server, "producer"))
        try:
            return await (await async_producer.handle(request_id)).result(timeout=5)
        finally:
            await async_producer.aclose()

    followed = asyncio.run(follow(handles[0].request_id))
    assert followed.outputs[0].token_ids == outputs[0].outputs[0].token_ids

    # the pool's gauges (a gateway's /metrics, run as the producer) read all they need
    gauges = PoolCollector(producer.redis, producer.keys).read()
    assert gauges["lorapool_audit_backlog"][1] == 0  # the writer committed all three
    assert gauges["lorapool_queue_length"][1] == producer.redis.xlen("lorapool:requests")

    denied = redis.exceptions.NoPermissionError
    with pytest.raises(denied):  # a producer cannot forge audit records
        producer.redis.xadd("lorapool:audit", {"data": b"{}"})
    with pytest.raises(denied):  # nor write a chunk log
        producer.redis.xadd("lorapool:out:{x}", {"data": b"{}"})
    with pytest.raises(denied):  # the writer cannot read jobs
        writer_conn.xrange("lorapool:requests")
    with pytest.raises(denied):  # the worker may publish only on request channels
        worker_conn.publish("elsewhere", b"x")
    with pytest.raises(denied):  # nor touch keys of another prefix
        worker_conn.get("other:model")
    with pytest.raises(denied):  # and nobody may reconfigure the server
        worker_conn.config_set("appendonly", "no")
