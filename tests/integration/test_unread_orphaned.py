"""Issue 31 Build 2, the started half: a worker wrote some chunks of a request and was
killed; an operator then removed the request's entry (XDEL, XTRIM), and another worker's
claim dropped it from the pending list (XAUTOCLAIM gives no request id for a deleted
entry). No worker will resume it, so its readers ask the workers to end it
(``lifecycle/orphaned.py``; issue 48: a worker ends it, on what only workers write):
every reader (``JobHandle``, ``AsyncJobHandle`` and so the gateway's follower) gets,
within seconds, one final chunk after exactly the chunks it had, with finish_reason
"error" saying it ran partially; the worker writes exactly one signed audit record
holding the tokens the log held.

Real Redis (both layouts), real ``Worker`` loops around the stand-in engine; the killed
worker is abandoned without its teardown (tests/integration/test_queue_stateful.py).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from pool_layout import async_result
from standin import load
from worker_loop import looping

from lorapool.connection import register_script
from lorapool.lifecycle import orphaned
from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.lifecycle.unread import EndUnread
from lorapool.protocol import SamplingParams
from lorapool.records.audit import parse_record
from lorapool.worker import Worker, WorkerConfig, unread_audit

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
LEASE_S = 1.0
SAYS = "it ran partially and cannot resume"
bench = load()
KEY = bench.AUDIT_KEY.encode()


def make_worker(conn, keys, name: str) -> Worker:
    config = WorkerConfig(
        prefix=keys.prefix, shards=keys.shards, name=name, audit_key=KEY, lease_s=LEASE_S
    )
    worker = Worker(bench.StandInEngine(8, 0.005), conn, config, bench.BASE_MODEL)
    worker.ensure_group()
    return worker


def run_until(worker: Worker, done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        worker.run_guarded()


def submit(producer, rid: str):
    return producer.submit("hello", SamplingParams(max_tokens=500, ignore_eos=True), request_id=rid)


def kill_partway(conn, keys, rid: str, how: str = "xdel", headless: bool = False) -> int:
    """For ``rid`` (submitted), let a worker write a few chunks, kill it (abandoned: no teardown,
    its sender closed) and remove the entry; the log's length then. ``headless``: the
    log deleted (an operator's DEL) after 5 chunks, so it is made again without them."""
    view = keys.for_request(rid)
    killed = make_worker(conn, keys, "killed")
    run_until(killed, lambda: conn.llen(view.out(rid)) >= 5)
    if headless:
        conn.delete(view.out(rid))
        run_until(killed, lambda: conn.llen(view.out(rid)) >= 3)
    killed.publisher.close()  # SIGKILL: nothing of it reaches Redis any more
    entry = conn.hget(view.job(rid), "entry").decode()
    if how == "xdel":
        assert conn.xdel(view.requests, entry) == 1
    else:
        conn.xtrim(view.requests, maxlen=0, approximate=False)
    assert EndUnread(conn, keys)(rid, "check") == 0  # pending to the killed worker
    return conn.llen(view.out(rid))


def drop_by_claim(conn, keys, rid: str, survivor: Worker) -> None:
    """The survivor's claim drops the deleted entry from the pending list."""
    stream = keys.for_request(rid).requests
    run_until(survivor, lambda: conn.xpending(stream, WORKERS_GROUP)["pending"] == 0)


def audit_records(conn, keys) -> list:
    return [
        parse_record(fields[b"data"], KEY, keys.prefix)
        for view in keys.shard_views
        for _, fields in conn.xrange(view.audit)
    ]


def read_all(handle, into: list) -> None:
    try:
        into.extend(handle.chunks(timeout=60))
    except Exception as exc:  # the test's assertion says what
        into.append(exc)


def test_a_killed_run_whose_entry_was_removed_ends_once(conn, keys, producer, pool_url):
    rid = "orphan"
    view = keys.for_request(rid)
    survivor = make_worker(conn, keys, "survivor")
    seen: list = []
    reader = threading.Thread(target=read_all, args=(submit(producer, rid), seen))
    try:
        reader.start()  # follows from the start, as the run goes
        length = kill_partway(conn, keys, rid)
        drop_by_claim(conn, keys, rid, survivor)
        started = time.monotonic()
        with looping(survivor):
            reader.join(orphaned.QUIET_S + 10)
        assert not reader.is_alive()
        assert time.monotonic() - started < orphaned.QUIET_S + 6
        logged = log_chunks(conn, keys, rid)
        assert len(logged) == length
        *chunks, final = seen
        assert [c.seq for c in chunks] == [c.seq for c in logged] == list(range(length))
        assert final.seq == length and final.finished and SAYS in final.error
        assert final.error_kind == "removed"
        assert [o.finish_reason for o in final.outputs] == ["error"]
        assert [o.token_ids for o in final.outputs] == [[]]  # nothing it had not
        assert conn.hget(view.run(rid), "status") == b"failed"
        assert EndUnread(conn, keys)(rid, "check") == 0  # ended once
        # a reader that comes later, and the follower (AsyncJobHandle, the gateway's)
        tokens = [t for c in logged for o in c.outputs for t in o.token_ids]
        later = producer.handle(rid).result(timeout=10)
        assert later.outputs[0].token_ids == tokens and SAYS in later.error
        followed = asyncio.run(async_result(pool_url, keys, rid))
        assert followed.outputs[0].token_ids == tokens and followed.error == later.error
        # its one audit record, by a worker's upkeep, with the tokens the log held
        run_until(survivor, lambda: audit_records(conn, keys))
        deadline = time.monotonic() + 3 * LEASE_S
        while time.monotonic() < deadline:
            survivor.run_guarded()
        (record,) = audit_records(conn, keys)
        assert record.request_id == rid and SAYS in record.error and "found:" in record.error
        assert [o.finish_reason for o in record.outputs] == ["error"]
        assert list(record.outputs[0].token_ids) == tokens
        assert record.metrics.num_generated_tokens == len(tokens)
        assert 0 < conn.ttl(view.out(rid)) <= survivor.config.log_grace_s
        assert not survivor.stopped
    finally:
        reader.join(1)
        survivor.teardown()


def test_an_async_reader_following_it_gets_the_end(conn, keys, producer, pool_url):
    rid = "orphan-async"
    survivor = make_worker(conn, keys, "survivor")
    try:
        submit(producer, rid)
        length = kill_partway(conn, keys, rid, how="xtrim")

        async def main():
            result = asyncio.ensure_future(async_result(pool_url, keys, rid))
            await asyncio.sleep(0.5)  # it follows, quiet
            await asyncio.to_thread(drop_by_claim, conn, keys, rid, survivor)
            started = time.monotonic()
            with looping(survivor):
                output = await result
            return output, time.monotonic() - started

        output, waited = asyncio.run(main())
        assert waited < orphaned.QUIET_S + 10  # polls at 1, 2, 4, 8 s
        assert output.finished and SAYS in output.error
        assert len(output.outputs[0].token_ids) == sum(
            c.num_tokens for c in log_chunks(conn, keys, rid)[:length]
        )
    finally:
        survivor.teardown()


def test_a_log_that_changed_since_it_was_read_is_left_alone(conn, keys, producer):
    rid = "orphan-not"
    view = keys.for_request(rid)
    worker = make_worker(conn, keys, "w")
    try:
        submit(producer, rid)
        length = kill_partway(conn, keys, rid)
        # pending to the killed worker (kill_partway); then dropped by a claim
        drop_by_claim(conn, keys, rid, worker)
        assert EndUnread(conn, keys)(rid, "check") == 1  # a reader asks
        script = register_script(conn, unread_audit.END_RUNS)
        (found,), _ = unread_audit._call(worker.state, script, view, "check", [[rid]])
        assert found == [rid.encode(), b"entry", length]
        final, record = unread_audit._records(worker.state, view, rid, "entry", length)
        # a chunk came (or went) since the worker read the log: the count refuses it
        for wrong in (length - 1, length + 1):
            ending = [[rid, "entry", wrong, final, record]]
            assert unread_audit._call(worker.state, script, view, "end", ending)[0] == []
        assert conn.hget(view.run(rid), "status") is None and not audit_records(conn, keys)
        ending = [[rid, "entry", length, final, record]]
        assert unread_audit._call(worker.state, script, view, "end", ending)[0] == [rid.encode()]
        assert unread_audit._call(worker.state, script, view, "end", ending)[0] == []
        assert len(audit_records(conn, keys)) == 1
    finally:
        worker.teardown()


def test_a_log_made_again_without_its_head_ends_with_what_it_holds(conn, keys, producer):
    """A log an operator deleted while the run went on (made again without its first
    chunks), then the worker killed and the entry deleted: a reader that takes none of
    the log's chunks (no seq 0) ends it all the same, with what the log holds."""
    rid = "orphan-headless"
    survivor = make_worker(conn, keys, "survivor")
    try:
        handle = submit(producer, rid)
        kill_partway(conn, keys, rid, headless=True)
        drop_by_claim(conn, keys, rid, survivor)
        logged = log_chunks(conn, keys, rid)
        assert logged[0].seq >= 5
        started = time.monotonic()
        with looping(survivor):
            output = handle.result(timeout=30)
        assert time.monotonic() - started < orphaned.QUIET_S + 4
        assert output.finished and SAYS in output.error
        tokens = [t for c in logged for o in c.outputs for t in o.token_ids]
        assert output.outputs[0].token_ids == tokens
    finally:
        survivor.teardown()
