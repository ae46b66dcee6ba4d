"""Issue 31 Build 2, the queued half: an entry an operator removes before any worker
read it (XTRIM MAXLEN 0, XDEL, the group destroyed and re-created at '$', DEL of the
stream) ends its request visibly, within seconds (a reader asks, a worker ends it:
issue 48): every reader (``JobHandle``,
``AsyncJobHandle``, and so the gateway's follower) gets one final chunk with
finish_reason "error" naming the cause, not a wait until its timeout.

Real Redis (both layouts); the readers are the producers' own; a real ``Worker`` loop
around the stand-in engine shows that what is still to be read, or held by a worker,
is left alone, that an ended request is never run, and that a worker then writes its
one audit record.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from standin import load
from worker_loop import looping

from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.lifecycle.unread import CAUSES, EndUnread
from lorapool.producer import AsyncProducer
from lorapool.protocol import SamplingParams
from lorapool.records.audit import parse_record
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
ENDED_WITHIN_S = 6.0  # a handle polls its quiet log each second, the follower at 1, 2 s
SAYS = "removed before any worker read it"
bench = load()


def make_worker(conn, keys) -> Worker:
    config = WorkerConfig(
        prefix=keys.prefix, shards=keys.shards, name="w", audit_key=bench.AUDIT_KEY.encode()
    )
    worker = Worker(bench.StandInEngine(8, 0.001), conn, config, bench.BASE_MODEL)
    worker.ensure_group()
    return worker


def remove(conn, stream: str, entry: str, how: str) -> None:
    """An operator's command that removes ``entry`` before any worker read it."""
    if how == "xtrim":
        conn.xtrim(stream, maxlen=0, approximate=False)
    elif how == "xdel":
        assert conn.xdel(stream, entry) == 1
    elif how == "group-reset":
        conn.xgroup_destroy(stream, WORKERS_GROUP)
        conn.xgroup_create(stream, WORKERS_GROUP, id="$")
    else:
        conn.delete(stream)


def assert_ended(output, started: float) -> None:
    assert time.monotonic() - started < ENDED_WITHIN_S
    assert output.finished and SAYS in output.error, output.error
    assert output.error_kind == "removed"
    assert [c.finish_reason for c in output.outputs] == ["error"]
    assert output.outputs[0].token_ids == []


@pytest.mark.parametrize("how", ["xtrim", "xdel", "group-reset", "del-stream"])
def test_an_entry_removed_before_any_worker_read_it_ends_its_request(
    conn, keys, producer, pool_url, how
):
    worker = make_worker(conn, keys)
    try:
        rid = f"gone-{how}"
        handle = producer.submit("hello", PARAMS, request_id=rid)
        stream = keys.for_request(rid).requests
        remove(conn, stream, conn.hget(keys.job(rid), "entry").decode(), how)
        started = time.monotonic()
        with looping(worker):  # a worker alive ends it (the reader only asks)
            output = handle.result(timeout=60)
        assert_ended(output, started)
        assert conn.hget(keys.run(rid), "status") == b"failed"
        assert 0 < conn.ttl(keys.run(rid)) <= 24 * 3600
        assert EndUnread(conn, keys)(rid) == 0  # ended once
        again = asyncio.run(follow(pool_url, keys, rid))  # the follower (the gateway's)
        assert again.error == output.error
        for _ in range(20):  # what a worker then does: nothing for it
            worker.run_guarded()
        assert not worker.stopped
        assert conn.exists(keys.out(rid)) == 0  # never run
        # no worker ran it; its one audit record, by the worker's upkeep
        # (tests/integration/test_unread_audit.py)
        (_, fields), *more = conn.xrange(keys.for_request(rid).audit)
        record = parse_record(fields[b"data"], bench.AUDIT_KEY.encode(), keys.prefix)
        found = {"xtrim": "entry", "xdel": "entry", "group-reset": "group", "del-stream": "stream"}
        assert not more and record.request_id == rid
        # a stream deleted is made again by the live worker (NOGROUP) before it ends the
        # request: it then finds the stream there without the entry
        causes = {found[how]} | ({"entry"} if how == "del-stream" else set())
        assert record.error in {f"{output.error}; found: {CAUSES[c]}" for c in causes}
        assert [o.finish_reason for o in record.outputs] == ["error"]
        assert [o.text for o in record.outputs] == [""] and not record.outputs[0].token_ids
        assert conn.hget(keys.run(rid), "status") == b"failed"
    finally:
        worker.teardown()


async def follow(url: str, keys, rid: str, remove_first: tuple | None = None):
    """The output of ``rid`` as an ``AsyncJobHandle`` reads it (the producer's
    ``Follower``); ``remove_first``: (conn, how) run on its entry once it follows."""
    producer = AsyncProducer(url, prefix=keys.prefix, shards=keys.shards)
    try:
        handle = await producer.handle(rid)
        result = asyncio.ensure_future(handle.result(timeout=60))
        if remove_first is not None:
            await asyncio.sleep(0.5)  # it follows, quiet
            conn, how = remove_first
            entry = conn.hget(keys.job(rid), "entry").decode()
            remove(conn, keys.for_request(rid).requests, entry, how)
        return await result
    finally:
        await producer.aclose()


def test_an_async_reader_following_it_gets_the_end(conn, keys, producer, pool_url):
    worker = make_worker(conn, keys)  # the groups, as a pool has them
    try:
        producer.submit("hello", PARAMS, request_id="gone-async")
        # removed before the live worker could read it, then followed
        entry = conn.hget(keys.job("gone-async"), "entry").decode()
        remove(conn, keys.for_request("gone-async").requests, entry, "group-reset")
        started = time.monotonic()
        with looping(worker):
            output = asyncio.run(follow(pool_url, keys, "gone-async"))
        assert_ended(output, started)
    finally:
        worker.teardown()


def test_what_is_to_be_read_or_held_is_left_alone(conn, keys, producer):
    """A queued entry, one a worker holds without output yet, one with a log whose entry
    was removed (the worker's to end), one past a group re-created at '0' (workers read it
    again) and a finished request: each is left as it is."""
    end = EndUnread(conn, keys)
    worker = make_worker(conn, keys)
    try:
        held = producer.submit("held", PARAMS, request_id="held")
        stream = keys.for_request("held").requests
        conn.xreadgroup(WORKERS_GROUP, "someone", {stream: ">"}, count=1)
        queued = producer.submit("queued", PARAMS, request_id="queued")
        assert [end("held"), end("queued")] == [0, 0]
        # a log, so a worker wrote for it: its entry removed under it is the worker's
        producer.submit("started", PARAMS, request_id="started")
        conn.rpush(keys.out("started"), b"{}")
        conn.xdel(keys.for_request("started").requests, conn.hget(keys.job("started"), "entry"))
        assert end("started") == 0
        conn.xgroup_destroy(stream, WORKERS_GROUP)  # held: now to be read again
        conn.xgroup_create(stream, WORKERS_GROUP, id="0")
        assert [end("held"), end("queued")] == [0, 0]
        assert {held.status(), queued.status()} == {"queued"}
        deadline = time.monotonic() + 20
        while {held.status(), queued.status()} != {"finished"}:
            assert time.monotonic() < deadline, "the worker did not run them"
            worker.run_guarded()
        assert [end("held"), end("queued")] == [0, 0]
        for handle in (held, queued):
            output = handle.result(timeout=5)
            assert output.error is None and len(output.outputs[0].token_ids) == 6
    finally:
        worker.teardown()
