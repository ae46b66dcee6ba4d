"""SETTLE (``lifecycle/response_settle.py``) against real Redis servers, standalone and
Cluster: a stored background response is rewritten only while it is queued or in
progress, keeps its expiry, and of two endings racing exactly one is stored."""

import asyncio

import orjson
import pytest

from lorapool.connection import connect_async
from lorapool.lifecycle.response_settle import Settle

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")


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
