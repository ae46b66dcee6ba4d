"""SETTLE (``lifecycle/response_settle.py``) against real Redis servers, standalone and
Cluster: a stored background response is rewritten only while it is queued or in
progress, keeps its expiry, and of two endings racing exactly one is stored; the
gateway's user of docs/redis-acl.md may run it."""

import asyncio
import re
from pathlib import Path

import orjson
import pytest
from redis_cluster import private_redis

from lorapool.connection import connect, connect_async
from lorapool.lifecycle.keys import Keys
from lorapool.lifecycle.response_settle import Settle

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
DOC = Path(__file__).resolve().parents[2] / "docs" / "redis-acl.md"


def _record(status: str) -> bytes:
    return orjson.dumps({"response": {"id": "resp_1", "status": status}, "conversation": []})


def _settle(pool_url: str, key: str, *records: bytes) -> list[bool]:
    """SETTLE of each record, all at once, on one asyncio client."""

    async def run() -> list[bool]:
        client = connect_async(pool_url)
        try:
            settle = Settle(client)
            return list(await asyncio.gather(*(settle(key, r) for r in records)))
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_only_a_pending_response_is_rewritten_and_keeps_its_expiry(conn, keys, pool_url):
    key = keys.response("t~resp_1")
    assert _settle(pool_url, key, _record("in_progress")) == [False]  # no record: none made
    assert not conn.exists(key)
    conn.set(key, _record("queued"), ex=100)
    assert _settle(pool_url, key, _record("in_progress")) == [True]
    assert _settle(pool_url, key, _record("completed")) == [True]
    assert orjson.loads(conn.get(key))["response"]["status"] == "completed"
    assert 0 < conn.ttl(key) <= 100
    assert _settle(pool_url, key, _record("cancelled")) == [False]  # ended: it stays
    assert orjson.loads(conn.get(key))["response"]["status"] == "completed"


def test_of_two_endings_racing_one_is_stored(conn, keys, pool_url):
    key = keys.response("t~resp_1")
    for _ in range(20):
        conn.set(key, _record("in_progress"), ex=100)
        endings = [_record("cancelled"), _record("completed")]
        won = _settle(pool_url, key, *endings)
        assert sorted(won) == [False, True]
        assert conn.get(key) == endings[won.index(True)]


def test_the_gateways_user_may_settle(layout, tmp_path):
    cluster = " cluster" if layout == "cluster" else ""
    [rule] = re.findall(rf"```acl gateway{cluster}\n(ACL SETUSER [^\n]+)\n```", DOC.read_text())
    with private_redis(layout, tmp_path / "redis") as server:
        for node in server.nodes:
            admin = node.client()
            admin.execute_command(*rule.replace("CHANGE-ME", "pw-0123").split())
            admin.close()
        key = Keys(shards=server.shards).response("t~resp_1")
        admin = connect(server.url)
        admin.set(key, _record("queued"), ex=100)
        gateway = server.url.replace("://", "://lorapool-gateway:pw-0123@", 1)
        assert _settle(gateway, key, _record("cancelled")) == [True]
        assert admin.get(key) == _record("cancelled")
        admin.close()
