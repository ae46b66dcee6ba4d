"""Issue 31 Builds 2 and 3 for a request whose queue entry an operator removed before
any worker read it: its reader asks the workers to end it (issue 48;
tests/integration/test_unread_removed.py), and a worker's upkeep ends it and writes its
one audit record, finish_reason "error" naming the cause, no output, with a log line;
two workers racing for it, or its id pushed again, still make one record and one row.

Real Redis (both layouts), the producers' own readers, real ``Worker`` loops around
the stand-in engine, and the real audit writer into SQLite or PostgreSQL.
"""

from __future__ import annotations

import logging
import threading
import time

import orjson
import pytest
from standin import load
from worker_loop import looping

from lorapool.audit_db import AuditWriter, WriterConfig
from lorapool.audit_db.queries import get_request
from lorapool.lifecycle import unread
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.lifecycle.unread import CAUSES, REASON, EndUnread
from lorapool.protocol import SamplingParams
from lorapool.records.audit import parse_record
from lorapool.worker import Worker, WorkerConfig, unread_audit

pytestmark = pytest.mark.integration
pytest_plugins = ["audit_fixtures"]
LAYOUTS = ("standalone", "cluster")
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
bench = load()
KEY = bench.AUDIT_KEY.encode()
TRIMMED = f"{REASON}; found: {CAUSES['entry']}"  # the record's error after an XTRIM


def make_worker(conn, keys, name: str = "w") -> Worker:
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, name=name, audit_key=KEY)
    worker = Worker(bench.StandInEngine(8, 0.001), conn, config, bench.BASE_MODEL)
    worker.ensure_group()
    return worker


def asked(producer, conn, keys, rids: list[str], reply: int = 1) -> list:
    """Submit ``rids``, XTRIM their streams to nothing, and ask, as their readers do,
    the workers to end each (``reply``: what each ask answers); their handles."""
    handles = [producer.submit("hello", PARAMS, request_id=rid) for rid in rids]
    for view in keys.shard_views:
        conn.xtrim(view.requests, maxlen=0, approximate=False)
    ask = EndUnread(conn, keys)
    assert [ask(rid) for rid in rids] == [reply] * len(rids)
    return handles


def assert_ended(handles) -> None:
    """Each reader gets the workers' end, within seconds."""
    started = time.monotonic()
    for handle in handles:
        output = handle.result(timeout=30)
        assert output.error == REASON and [o.finish_reason for o in output.outputs] == ["error"]
    assert time.monotonic() - started < 6 * len(handles)


def audit_records(conn, keys) -> dict[str, list]:
    """request id -> the records of the audit streams (their signatures checked)."""
    records: dict[str, list] = {}
    for view in keys.shard_views:
        for _, fields in conn.xrange(view.audit):
            record = parse_record(fields[b"data"], KEY, keys.prefix)
            records.setdefault(record.request_id, []).append(record)
    return records


def write_rows(conn, keys, target) -> int:
    config = WriterConfig(prefix=keys.prefix, shards=keys.shards, audit_key=KEY)
    return AuditWriter(conn, target.engine, config).run(burst=True).rows_written


def listed(conn, keys) -> int:
    return sum(conn.llen(view.unread_ended) for view in keys.shard_views)


def test_an_xtrimmed_job_gets_one_error_audit_row_and_a_log_line(
    conn, keys, producer, audit_target, caplog
):
    worker = make_worker(conn, keys)
    try:
        handles = asked(producer, conn, keys, ["trimmed"])
        assert listed(conn, keys) == 1
        with caplog.at_level(logging.ERROR, logger="lorapool.worker.unread_audit"):
            for _ in range(3):  # the loop's upkeep, as ``lorapool worker`` runs it
                worker.run_guarded()
        assert not worker.stopped
        lines = [r.getMessage() for r in caplog.records if r.name == unread_audit.__name__]
        assert len(lines) == 1 and "request trimmed" in lines[0] and TRIMMED in lines[0]
        records = audit_records(conn, keys)
        assert list(records) == ["trimmed"] and len(records["trimmed"]) == 1
        record = records["trimmed"][0]
        assert record.error == TRIMMED and record.worker == "w"
        assert [(o.index, o.finish_reason, o.token_ids) for o in record.outputs] == [
            (0, "error", ())
        ]
        # never run: no worker saw it arrive, so its times are when a worker ended it
        assert record.metrics.arrival_time == record.metrics.finished_time
        assert listed(conn, keys) == 0
        assert conn.hget(keys.run("trimmed"), "status") == b"failed"
        assert_ended(handles)
        assert write_rows(conn, keys, audit_target) == 1
        rows = get_request(audit_target.engine, "trimmed")
        assert [(r["finish_reason"], r["error"]) for r in rows] == [("error", TRIMMED)]
        assert conn.exists(keys.out("trimmed")) == 0  # never run
    finally:
        worker.teardown()


def test_two_workers_racing_write_one_record_each(conn, keys, producer, audit_target):
    rids = [f"race-{i}" for i in range(12)]
    handles = asked(producer, conn, keys, rids)
    workers = [make_worker(conn, keys, name) for name in ("w1", "w2")]
    try:
        start, counts = threading.Barrier(2), {}

        def record(worker):
            start.wait()
            counts[worker.name] = unread_audit.record_ended(worker.state)

        threads = [threading.Thread(target=record, args=(w,)) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sum(counts.values()) == len(rids)
        records = audit_records(conn, keys)
        assert sorted(records) == sorted(rids)
        assert {len(r) for r in records.values()} == {1}
        assert_ended(handles)
        # the same ids pushed again (a re-run, or anyone with a producer's rights):
        # taken off the list, no second record
        for rid in rids[:3]:
            conn.rpush(keys.for_request(rid).unread_ended, rid)
        for worker in workers:
            for _ in range(2):
                worker.run_guarded()
                worker._last["unread"] = 0.0  # due again at once
        assert listed(conn, keys) == 0
        assert {len(r) for r in audit_records(conn, keys).values()} == {1}
        assert write_rows(conn, keys, audit_target) == len(rids)
        for rid in rids:
            rows = get_request(audit_target.engine, rid)
            assert [(r["finish_reason"], r["error"]) for r in rows] == [("error", TRIMMED)]
    finally:
        for worker in workers:
            worker.teardown()


def test_an_id_no_reader_ended_gets_no_record(conn, keys, producer):
    """Ids pushed on the list by hand (as a producer's user may): a queued request, one a
    worker holds, one that ran, one that never existed, and bytes that are no id. Each
    is taken off the list and none gets a record; the queued one then runs as usual."""
    worker = make_worker(conn, keys)
    try:
        queued = producer.submit("queued", PARAMS, request_id="queued")
        held = producer.submit("held", PARAMS, request_id="held")
        stream = keys.for_request("held").requests
        conn.xreadgroup(WORKERS_GROUP, "someone", {stream: ">"}, count=5)
        conn.hset(keys.job("held"), mapping={"status": "failed", "unread": "1"})  # forged
        for rid in ("queued", "held", "nobody"):
            conn.rpush(keys.for_request(rid).unread_ended, rid)
        conn.rpush(keys.on(0).unread_ended, b"\xff\xfe")
        assert unread_audit.record_ended(worker.state) == 0
        assert listed(conn, keys) == 0 and audit_records(conn, keys) == {}
        conn.xgroup_setid(stream, WORKERS_GROUP, id="0")  # queued: to be read again
        conn.hset(keys.job("held"), "status", "queued")
        conn.xgroup_delconsumer(stream, WORKERS_GROUP, "someone")
        deadline = time.monotonic() + 20
        while queued.status() != "finished" or held.status() != "finished":
            assert time.monotonic() < deadline, "the worker did not run them"
            worker.run_guarded()
        conn.rpush(keys.for_request("queued").unread_ended, "queued")  # one that ran
        assert unread_audit.record_ended(worker.state) == 0
        records = audit_records(conn, keys)
        assert sorted(records) == ["held", "queued"]
        assert [r.outputs[0].finish_reason for r in records["queued"]] == ["length"]
    finally:
        worker.teardown()


def test_the_record_reads_back_as_the_audit_writer_reads_it(conn, keys, producer):
    """What RECORD_UNREAD stored is the signed record ``unread_record`` built."""
    worker = make_worker(conn, keys)
    try:
        asked(producer, conn, keys, ["plain"])
        assert unread_audit.record_ended(worker.state) == 1
        (_, fields), *_ = conn.xrange(keys.for_request("plain").audit)
        data = orjson.loads(fields[b"data"])
        assert data["v"] == 1 and data["sig"] and data["metadata"] == {}
        assert data["base_model"] == {
            "name": bench.BASE_MODEL.name,
            "sha256": bench.BASE_MODEL.sha256,
        }
    finally:
        worker.teardown()


def test_a_list_of_another_type_costs_the_record_only(conn, keys, producer, caplog):
    """``unread-ended`` SET to a string (a producer may write it): the reader's ask fails,
    saying no worker can end it; the worker's loop logs it and goes on (not as if Redis
    were away). Once an operator deletes the key, the reader's next ask ends it and it
    is recorded."""
    worker = make_worker(conn, keys)
    try:
        for view in keys.shard_views:
            conn.set(view.unread_ended, "x")
        with caplog.at_level(logging.WARNING):
            (handle,) = asked(producer, conn, keys, ["recorded"], reply=2)
            unread.log_ended("recorded", 2)
            for _ in range(3):
                worker.run_guarded()
        assert not worker.stopped and worker._away_since is None
        said = [r.getMessage() for r in caplog.records]
        assert any("recorded: " in line and "no worker can end it" in line for line in said)
        assert any("holds another type than a list" in line for line in said), said
        assert audit_records(conn, keys) == {}
        for view in keys.shard_views:
            conn.delete(view.unread_ended)
        with looping(worker):
            assert_ended([handle])
        assert list(audit_records(conn, keys)) == ["recorded"]
    finally:
        worker.teardown()
