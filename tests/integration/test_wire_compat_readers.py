"""Readers of today read what writers of an earlier version left in Redis. The job hashes
and chunk logs of ``tests/unit/wire_fixtures/<commit>.json`` (written by that commit's
real worker) are put back into a fresh pool, as an upgrade finds them, the first worker
of today moves them to today's layout (``lifecycle/run_state.migrate``, issue 48: a
job's run in a key only workers write), and today's producers read them: ``result()``,
``stream()`` and ``status()``, sync and asyncio, with the chunk log still there and
after it was compacted away (the final record alone). They must give what that commit's
producer gave. ``error_kind``, added to outputs since, reads as None on a request that
did not fail and as the kind the old text rule gives (``error_kind.read_kind``) on one
that did.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import orjson
import pytest

from lorapool.lifecycle import run_state
from lorapool.producer import AsyncProducer
from lorapool.records.error_kind import ErrorKind

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
FIXTURES = sorted((Path(__file__).parents[1] / "unit" / "wire_fixtures").glob("*.json"))


def raw(value: dict[str, str]) -> bytes:
    return value["text"].encode() if "text" in value else base64.b64decode(value["b64"])


def plain(output) -> dict:
    return orjson.loads(orjson.dumps(output.to_dict()))


def as_then(now: dict, then: dict) -> dict:
    """``now`` (an output's dict today) without the fields the fixture's version did not
    have yet, after checking what they read as."""
    added = {k: v for k, v in now.items() if k not in then}
    assert set(added) <= {"error_kind"}, added
    if "error_kind" in added:
        kind = added["error_kind"]
        assert kind is None if now["error"] is None else kind in set(ErrorKind), now
    return {k: v for k, v in now.items() if k in then}


def put_back(conn, keys, rid: str, request: dict, with_log: bool) -> None:
    marker = {k: raw(v) for k, v in request["job_hash"].items()}
    conn.hset(keys.job(rid), mapping=marker)
    if with_log and request["chunks"]:
        conn.rpush(keys.out(rid), *[raw(c["raw"]) for c in request["chunks"]])


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
@pytest.mark.parametrize("with_log", [True, False], ids=["log", "compacted"])
def test_producers_read_old_outputs(conn, keys, producer, pool_url, shards, path, with_log):
    fixture = orjson.loads(path.read_bytes())
    requests = fixture["requests"]
    for rid, request in requests.items():
        put_back(conn, keys, rid, request, with_log)
    assert run_state.migrate(conn, keys) == len(requests)  # what a worker does at start
    assert run_state.migrate(conn, keys) == 0  # once a pool
    for rid, request in requests.items():
        handle = producer.handle(rid)
        assert handle.status() == request["status"], rid
        expected = request["result"]
        assert as_then(plain(handle.result(timeout=5)), expected) == expected, rid
        if with_log:
            stream = [plain(o) for o in handle.stream(timeout=5)]
            assert [as_then(o, e) for o, e in zip(stream, request["stream"])] == request["stream"]
            assert len(stream) == len(request["stream"]), rid

    async def read_async() -> dict:
        aproducer = AsyncProducer(pool_url, keys.prefix, shards=shards)
        try:
            return {
                rid: plain(await (await aproducer.handle(rid)).result(timeout=5))
                for rid in requests
            }
        finally:
            await aproducer.aclose()

    results = asyncio.run(read_async())
    for rid, request in requests.items():
        assert as_then(results[rid], request["result"]) == request["result"], rid
