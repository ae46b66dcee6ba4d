"""The audit writer against real Redis and SQL (SQLite and PostgreSQL)."""

import contextlib
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import orjson
import pytest
from audit_fixtures import FAST_WRITER, KEY
from sqlalchemy import make_url, text

from lorapool.audit_db import (
    AuditWriter,
    DatabaseConfig,
    WriterConfig,
    create_audit_engine,
    migrate,
    verify_chain,
)
from lorapool.records.dead_letter import decode_dead_letter

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")


def _writer(audit_redis, engine, **kw) -> AuditWriter:
    config = WriterConfig(
        prefix=audit_redis.prefix,
        shards=audit_redis.shards,
        consumer=kw.pop("consumer", "w-test"),
        **{**FAST_WRITER, **kw},
    )
    return AuditWriter(audit_redis.conn, engine, config)


@contextlib.contextmanager
def _running(writer: AuditWriter):
    thread = threading.Thread(target=writer.run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        writer.stop()
        thread.join(10)
        assert not thread.is_alive()


@pytest.mark.parametrize("batch_size", [1, 500])
def test_the_same_entry_three_times_gives_one_row(audit_target, audit_redis, batch_size):
    from audit_fixtures import make_adapter, make_record

    audit_redis.publish([make_record(1, adapter=make_adapter(), n=2)] * 3)
    stats = _writer(audit_redis, audit_target.engine, batch_size=batch_size).run(burst=True)
    assert audit_target.count() == 2
    assert (stats.rows_written, stats.duplicates, stats.entries) == (2, 4, 3)
    assert audit_redis.pending() == 0
    assert verify_chain(audit_target.engine, key=KEY).ok


def test_without_prefetch_every_batch_is_read_in_turn(audit_target, audit_redis):
    """``prefetch=False`` (``--no-prefetch``): batches read and stored one after the
    other in the writer's thread, every entry stored once and acked."""
    from audit_fixtures import make_record

    audit_redis.publish([make_record(i) for i in range(7)])
    writer = _writer(audit_redis, audit_target.engine, batch_size=2, prefetch=False)
    stats = writer.run(burst=True)
    assert writer._ahead is None  # nothing was read ahead
    assert (stats.rows_written, stats.entries, audit_target.count()) == (7, 7, 7)
    assert audit_redis.pending() == 0
    assert verify_chain(audit_target.engine, key=KEY).ok


def test_stale_pending_entries_of_a_dead_writer_are_reclaimed(audit_target, audit_redis):
    from audit_fixtures import make_record

    audit_redis.publish([make_record(i) for i in range(5)])
    writer = _writer(audit_redis, audit_target.engine, claim_idle_ms=100)
    writer.ensure_group()
    for view in audit_redis.keys.shard_views:
        audit_redis.conn.xreadgroup("audit", "crashed", {view.audit: ">"}, count=5)
    assert audit_redis.pending() == 5
    time.sleep(0.2)
    writer.run(burst=True)
    assert audit_target.count() == 5 and audit_redis.pending() == 0


def test_a_read_whose_reply_was_lost_is_read_again(audit_target, audit_redis):
    """Entries Redis delivered to the writer's own consumer on a read whose reply never
    reached it (redis-py retried the read after a timeout, say, in a Redis stall) are
    read back within ``claim_every_s``, not left for ``claim_idle_ms``."""
    from audit_fixtures import make_record

    from lorapool import signing
    from lorapool.records.audit import sign_record

    # three requests of one shard: a transaction stays on one stream (one cluster slot)
    one_shard = [i for i in range(100) if audit_redis.keys.shard_of(f"req-{i}") == 0][:3]
    writer = _writer(audit_redis, audit_target.engine, claim_every_s=0.2)
    with _running(writer):
        time.sleep(0.3)  # past its start, which re-reads its own pending entries anyway
        stream, key = audit_redis.keys.on(0).audit, signing.key_from_env()
        pipe = audit_redis.conn.pipeline(transaction=True)  # the writer sees none come
        for i in one_shard:
            record = sign_record(make_record(i), key, audit_redis.prefix)
            pipe.xadd(stream, {"data": orjson.dumps(record)})
        pipe.xreadgroup("audit", "w-test", {stream: ">"}, count=3)  # the lost read
        reply = pipe.execute()[-1]  # a cluster transaction leaves it unparsed: {stream: [...]}
        entries = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
        assert len(entries) == 3
        deadline = time.monotonic() + 5
        while audit_target.count() < 3:
            assert time.monotonic() < deadline, "the lost read's entries were not read again"
            time.sleep(0.05)
    assert audit_redis.pending() == 0


def test_malformed_entries_are_dead_lettered(audit_target, audit_redis):
    from audit_fixtures import make_record

    bad_version = {**make_record(2), "v": 99}
    audit_redis.publish([make_record(1), bad_version, make_record(3)])
    # on req-2's shard: its dead stream then holds all three, in this order
    audit_redis.conn.xadd(audit_redis.audit("req-2"), {"data": b"{not json"})
    audit_redis.conn.xadd(audit_redis.audit("req-2"), {"other": b"x"})
    stats = _writer(audit_redis, audit_target.engine).run(burst=True)
    assert audit_target.count() == 2 and stats.dead_lettered == 3
    dead = audit_redis.dead()
    letters = [decode_dead_letter(fields) for _id, fields in dead]
    reasons = [letter.reason for letter in letters]
    assert {(letter.source, letter.stream) for letter in letters} == {
        ("audit", audit_redis.audit("req-2"))
    }
    assert all(letter.worker and letter.entry for letter in letters)
    assert "unknown record version 99" in reasons[0]
    assert "not valid JSON" in reasons[1] and "no 'data' field" in reasons[2]
    assert audit_redis.pending() == 0


def test_a_nul_byte_in_the_text_is_stored_on_both_dialects(audit_target, audit_redis):
    from audit_fixtures import make_record

    from lorapool.audit_db import get_request

    nul = make_record(4, text_for=lambda i, k: "a\x00b")
    audit_redis.publish(
        [make_record(i) for i in range(4)] + [nul] + [make_record(i) for i in range(5, 10)]
    )
    stats = _writer(audit_redis, audit_target.engine, batch_size=10).run(burst=True)
    assert audit_target.count() == 10 and stats.dead_lettered == 0
    assert [r["text"] for r in get_request(audit_target.engine, "req-4")] == ["a\x00b"]
    assert audit_redis.pending() == 0 and verify_chain(audit_target.engine, key=KEY).ok


def test_a_value_its_column_cannot_hold_dead_letters_its_entry_alone(audit_target, audit_redis):
    """A record whose token count does not fit PostgreSQL's ``integer``: its entry is
    dead-lettered with the column named (the binary COPY refuses it before the server
    would), the rest of its batch is stored and the chain verifies. SQLite's integers
    hold it: stored there."""
    from audit_fixtures import make_record

    huge = make_record(3)
    huge["metrics"] = {**huge["metrics"], "num_prompt_tokens": 2**40}
    audit_redis.publish([make_record(i) for i in range(3)] + [huge, make_record(4)])
    stats = _writer(audit_redis, audit_target.engine, batch_size=10).run(burst=True)
    if audit_target.engine.dialect.name == "postgresql":
        assert audit_target.count() == 4 and stats.dead_lettered == 1
        (letter,) = [decode_dead_letter(fields) for _id, fields in audit_redis.dead()]
        assert "num_prompt_tokens" in letter.reason and str(2**40) in letter.reason
    else:
        assert audit_target.count() == 5 and stats.dead_lettered == 0
    assert audit_redis.pending() == 0 and verify_chain(audit_target.engine, key=KEY).ok


def test_a_rolled_back_first_write_leaves_no_keyed_start_or_partition_behind(audit_target):
    """A refused first write in a month with no partition yet rolls back the partition
    and the chain's keyed start; one guard's next write makes both again (it used to
    skip the partition, which no longer existed, and checkpoint a keyed start that
    ``audit_meta`` lacked) and the chain verifies."""
    from audit_fixtures import make_record
    from sqlalchemy.exc import DataError

    from lorapool.audit_db.guard import ChainGuard
    from lorapool.audit_db.rows import prepare
    from lorapool.audit_db.store import append
    from lorapool.records.audit import record_from_dict

    at = 2_000_000_000.0  # 2033-05: no partition made by the migrations
    bad = make_record(1)
    bad["metrics"] = {**bad["metrics"], "num_prompt_tokens": 2**40}
    guard = ChainGuard(KEY)

    def rows(records):
        return [row for r in records for row in prepare(record_from_dict(r), "p", now=at)]

    if audit_target.kind == "postgresql":
        with pytest.raises(DataError, match="num_prompt_tokens"):
            append(audit_target.engine, rows([make_record(0), bad]), KEY, guard, now=at)
        assert audit_target.count() == 0
    assert append(audit_target.engine, rows([make_record(2)]), KEY, guard, now=at).written == 1
    assert append(audit_target.engine, rows([make_record(3)]), KEY, guard, now=at).written == 1
    assert verify_chain(audit_target.engine, key=KEY).ok


def _consumers(audit_redis) -> int:
    """The consumers of the audit group, on the shard that has the fewest."""
    try:
        views = audit_redis.keys.shard_views
        return min(len(audit_redis.conn.xinfo_consumers(v.audit, "audit")) for v in views)
    except Exception:
        return 0


def _start_writer_process(audit_redis, audit_target, name):
    args = [
        sys.executable,
        "-c",
        "from lorapool.cli.main import main; main()",
        "audit-writer",
        "--redis-url",
        audit_redis.url,
        "--prefix",
        audit_redis.prefix,
        "--shards",
        str(audit_redis.shards),
        *audit_target.cli_args(),
        "--consumer",
        name,
        "--batch-size",
        "200",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def test_ten_thousand_records_through_two_writer_processes(audit_target, audit_redis):
    from audit_fixtures import make_adapter, make_record, wait_for

    procs = [_start_writer_process(audit_redis, audit_target, f"w{i}") for i in (1, 2)]
    try:
        assert wait_for(lambda: _consumers(audit_redis) == 2, timeout=60)
        adapters = [None, make_adapter("a", 1), make_adapter("b", 2)]
        audit_redis.publish(
            [make_record(i, adapter=adapters[i % 3]) for i in range(10_000)], chunk=250
        )
        assert wait_for(lambda: audit_target.count() == 10_000, timeout=180, interval=0.2)
        assert wait_for(lambda: audit_redis.pending() == 0, timeout=30)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    written = [int(re.search(r"rows written (\d+)", out).group(1)) for out in outputs]
    assert all(proc.returncode == 0 for proc in procs), outputs
    assert sum(written) == 10_000 and min(written) > 0, written
    report = verify_chain(audit_target.engine, key=KEY)
    assert report.ok and report.num_rows == 10_000 and report.head_seq == 10_000


def _pg_outage(audit_location, audit_redis, caplog):
    """PostgreSQL behind a TCP proxy on a port of its own: the proxy is the outage."""
    from audit_fixtures import TcpProxy, free_port

    _kind, url, schema = audit_location
    real = create_audit_engine(DatabaseConfig(url=url, schema=schema))
    migrate(real)
    target = make_url(url)
    proxy = TcpProxy(free_port(), (target.host or "127.0.0.1", target.port or 5432))
    proxied = target.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    writer_engine = create_audit_engine(DatabaseConfig(url=proxied, schema=schema))
    return real, writer_engine, proxy.start, proxy.stop


def _sqlite_outage(audit_location, tmp_path):
    """SQLite: first the file's folder is missing, later another connection holds the lock."""
    path = tmp_path / "not-mounted-yet" / "audit.sqlite"
    url = f"sqlite:///{path}"
    real = create_audit_engine(DatabaseConfig(url=url))
    writer_engine = create_audit_engine(DatabaseConfig(url=url, busy_timeout_ms=50))
    locker = {}

    def up():
        if "conn" in locker:
            locker.pop("conn").close()  # rolls back, releasing the lock
        else:
            migrate(real)

    def down():
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        locker["conn"] = conn

    return real, writer_engine, up, down


def _count(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM completions")).scalar()


def test_database_down_then_back_loses_nothing(audit_location, audit_redis, caplog, tmp_path):
    from audit_fixtures import make_record, wait_for

    caplog.set_level(logging.WARNING, logger="lorapool.audit_db.writer")
    if audit_location[0] == "postgresql":
        real, engine, up, down = _pg_outage(audit_location, audit_redis, caplog)
    else:
        real, engine, up, down = _sqlite_outage(audit_location, tmp_path)
    writer = _writer(audit_redis, engine, batch_size=50)
    with _running(writer):
        audit_redis.publish([make_record(i) for i in range(100)])
        assert wait_for(lambda: writer.stats.db_retries >= 3)
        up()
        assert wait_for(lambda: _count(real) == 100)
        down()
        audit_redis.publish([make_record(i) for i in range(100, 200)])
        assert wait_for(lambda: audit_redis.pending() > 0)
        retries = writer.stats.db_retries
        assert wait_for(lambda: writer.stats.db_retries >= retries + 3)
        assert _count(real) == 100 and audit_redis.pending() > 0  # nothing acked meanwhile
        up()
        assert wait_for(lambda: _count(real) == 200 and audit_redis.pending() == 0)
        down_logs = [r.getMessage() for r in caplog.records if "cannot" in r.getMessage()]
    assert any("nothing acked" in m for m in down_logs)
    assert verify_chain(real, key=KEY).ok
    real.dispose()
    engine.dispose()


def test_a_writer_waits_for_the_migration(audit_location, audit_redis, caplog):
    from audit_fixtures import make_record, wait_for

    _kind, url, schema = audit_location
    engine = create_audit_engine(DatabaseConfig(url=url, schema=schema))
    audit_redis.publish([make_record(i) for i in range(10)])
    writer = _writer(audit_redis, engine)
    with _running(writer):
        assert wait_for(lambda: writer.stats.db_retries >= 2)
        assert any("lorapool audit migrate" in r.getMessage() for r in caplog.records)
        migrator = create_audit_engine(DatabaseConfig(url=url, schema=schema))
        migrate(migrator)
        migrator.dispose()
        assert wait_for(lambda: _count(engine) == 10 and audit_redis.pending() == 0)
    engine.dispose()


def test_a_writer_can_migrate_on_start(audit_location, audit_redis):
    from audit_fixtures import make_record

    _kind, url, schema = audit_location
    engine = create_audit_engine(DatabaseConfig(url=url, schema=schema))
    audit_redis.publish([make_record(i) for i in range(10)])
    _writer(audit_redis, engine, migrate=True).run(burst=True)
    assert _count(engine) == 10 and verify_chain(engine, key=KEY).ok
    engine.dispose()
