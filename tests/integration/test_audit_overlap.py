"""The writer's work while PostgreSQL inserts a batch (bulk.py's ``meanwhile``): it runs
after the COPY is ended and before its answer is read, so the server inserts while the
writer parses its next batch and chains it ahead (chaining.py); a failure on either
side leaves the connection usable and nothing half-stored, and a batch chained ahead
is stored as chained only when nothing it assumed has changed. PostgreSQL only (SQLite
inserts in the writer's own process)."""

import random
import threading

import pytest
from audit_fixtures import FAST_WRITER, KEY, make_adapter, make_record
from sqlalchemy import create_engine, event, select, text
from sqlalchemy.exc import IntegrityError

from lorapool.audit_db import AuditWriter, WriterConfig, chaining, rollup, verify_chain
from lorapool.audit_db.database import write_transaction
from lorapool.audit_db.guard import ChainGuard
from lorapool.audit_db.rows import prepare
from lorapool.audit_db.schema import usage_daily
from lorapool.audit_db.store import append
from lorapool.records.audit import record_from_dict
from lorapool.records.dead_letter import decode_dead_letter

pytest_plugins = ["audit_fixtures"]
pytestmark = [
    pytest.mark.integration,
    pytest.mark.parametrize("audit_location", ["postgresql"], indirect=True),
]

# a server slowed to 20 ms a row, so that its inserting outlasts the client's next step
SLOW = """
CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(0.02); RETURN NEW; END $$;
CREATE TRIGGER slow_insert BEFORE INSERT ON completions
  FOR EACH ROW EXECUTE FUNCTION slow_insert();
"""
# a server that refuses one request's row, as a constraint would
REFUSE = """
CREATE FUNCTION refuse_req_3() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.request_id = 'req-3' THEN
    RAISE EXCEPTION 'refused by a test' USING ERRCODE = 'check_violation';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER refuse_req_3 BEFORE INSERT ON completions
  FOR EACH ROW EXECUTE FUNCTION refuse_req_3();
"""


def _rows(ids):
    return [row for i in ids for row in prepare(record_from_dict(make_record(i)))]


def _backend_pids(engine) -> list[int]:
    """The backend pid of every connection ``engine`` checks out, in order."""
    pids = []
    event.listen(
        engine, "checkout", lambda dbapi, _rec, _proxy: pids.append(dbapi.info.backend_pid)
    )
    return pids


def _run_writer(audit_target, audit_redis, **config):
    """One writer's burst over what is on the streams (quick polls); its stats."""
    layout = {"prefix": audit_redis.prefix, "shards": audit_redis.shards, "consumer": "w-1"}
    writer_config = WriterConfig(**layout, **FAST_WRITER, **config)
    return AuditWriter(audit_redis.conn, audit_target.engine, writer_config).run(burst=True)


def test_the_callers_work_runs_while_the_server_inserts(audit_target):
    with audit_target.engine.begin() as conn:
        conn.exec_driver_sql(SLOW)
    pids, seen = _backend_pids(audit_target.engine), []
    observer = create_engine(audit_target.url)

    def meanwhile() -> bool:
        with observer.connect() as conn:
            state = conn.execute(
                text("SELECT state, query FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pids[-1]},
            ).one()
        seen.append((state[0], state[1].split("(")[0].strip()))
        return len(seen) < 3

    try:
        result = append(audit_target.engine, _rows(range(20)), KEY, meanwhile=meanwhile)
    finally:
        observer.dispose()
    # three calls, each while the backend was still running the COPY (400 ms of rows)
    assert seen == [("active", "COPY completions")] * 3
    assert result.written == 20 and audit_target.count() == 20
    assert verify_chain(audit_target.engine, key=KEY).ok


def test_a_failure_of_the_callers_work_rolls_the_batch_back(audit_target):
    def meanwhile() -> bool:
        raise RuntimeError("the caller's own failure")

    with pytest.raises(RuntimeError, match="the caller's own failure"):
        append(audit_target.engine, _rows(range(5)), KEY, meanwhile=meanwhile)
    assert audit_target.count() == 0
    # the connection went back to the pool usable: the next batch is stored and chained
    assert append(audit_target.engine, _rows(range(5, 9)), KEY).written == 4
    assert audit_target.count() == 4 and verify_chain(audit_target.engine, key=KEY).ok


def test_a_backend_gone_while_the_caller_works_is_an_error_to_retry(audit_target):
    """The server's backend ends (a restart, an admin) between the COPY's end and its
    answer: a DBAPIError the writer retries, nothing stored, and the pool's next
    connection stores the same rows."""
    from sqlalchemy.exc import DBAPIError

    from lorapool.audit_db.writer_retry import REJECTED

    pids = _backend_pids(audit_target.engine)
    admin = create_engine(audit_target.url)

    def meanwhile() -> bool:
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pids[-1]})
        return False

    rows = _rows(range(5))
    try:
        with pytest.raises(DBAPIError) as raised:
            append(audit_target.engine, rows, KEY, meanwhile=meanwhile)
    finally:
        admin.dispose()
    assert not isinstance(raised.value, REJECTED)  # retried, not bisected and dead-lettered
    assert audit_target.count() == 0
    assert append(audit_target.engine, rows, KEY).written == 5
    assert verify_chain(audit_target.engine, key=KEY).ok


def test_a_row_the_server_refuses_is_reported_after_the_callers_work(audit_target):
    with audit_target.engine.begin() as conn:
        conn.exec_driver_sql(REFUSE)
    calls = []

    def meanwhile() -> bool:
        calls.append(1)
        return False

    with pytest.raises(IntegrityError, match="refused by a test"):
        append(audit_target.engine, _rows(range(6)), KEY, meanwhile=meanwhile)
    assert calls == [1] and audit_target.count() == 0


def test_the_writer_reading_ahead_dead_letters_only_the_refused_entry(audit_target, audit_redis):
    """The writer reads and parses each next batch while the server inserts the one
    before: a row the server refuses (found only when the COPY's answer is read) is
    dead-lettered alone, every other entry stored once, nothing left pending."""
    with audit_target.engine.begin() as conn:
        conn.exec_driver_sql(REFUSE)
    audit_redis.publish([make_record(i) for i in range(9)])
    stats = _run_writer(audit_target, audit_redis, batch_size=2)
    assert (stats.rows_written, stats.dead_lettered, stats.duplicates) == (8, 1, 0)
    (letter,) = [decode_dead_letter(fields) for _id, fields in audit_redis.dead()]
    assert "refused by a test" in letter.reason
    assert audit_target.count() == 8 and audit_redis.pending() == 0
    assert verify_chain(audit_target.engine, key=KEY).ok


def _chain_ahead(guard: ChainGuard, rows):
    """A ``meanwhile`` that chains ``rows`` ahead onto the rows being inserted, as the
    writer's NextBatch does, and the list it puts the result in."""
    made = []

    def meanwhile() -> bool:
        made.append(chaining.ahead(rows, guard))
        return False

    return meanwhile, made


def test_a_batch_chained_ahead_is_stored_as_chained(audit_target):
    guard = ChainGuard(KEY)
    meanwhile, made = _chain_ahead(guard, later := _rows(range(5, 10)))
    append(audit_target.engine, _rows(range(5)), KEY, guard, meanwhile=meanwhile)
    (early,) = made
    assert early is not None and early.head.seq == 5
    result = append(audit_target.engine, later, KEY, guard, early=early)
    assert result.chained_ahead and result.written == 5
    assert audit_target.count() == 10 and verify_chain(audit_target.engine, key=KEY).ok


def _another_writer(audit_target, guard):
    """Another writer stores three rows between the two batches."""
    append(audit_target.engine, _rows(range(20, 23)), KEY, ChainGuard(KEY))


def _a_redelivery(audit_target, guard):
    """Nothing between: the later batch repeats a row of the first."""


@pytest.mark.parametrize("between", [_another_writer, _a_redelivery])
def test_a_batch_chained_ahead_is_chained_again_when_the_chain_moved(audit_target, between):
    guard = ChainGuard(KEY)
    first = _rows(range(5))
    later = _rows(range(5, 9)) + (first[-1:] if between is _a_redelivery else [])
    meanwhile, made = _chain_ahead(guard, later)
    append(audit_target.engine, first, KEY, guard, meanwhile=meanwhile)
    between(audit_target, guard)
    result = append(audit_target.engine, later, KEY, guard, early=made[0])
    assert not result.chained_ahead and result.written == 4
    assert result.duplicates == (between is _a_redelivery)
    expected = 9 + 3 * (between is _another_writer)
    assert audit_target.count() == expected and verify_chain(audit_target.engine, key=KEY).ok


def test_a_batch_chained_onto_a_refused_one_is_chained_again(audit_target):
    """The batch before was refused when its answer was read (after the later one was
    chained onto it): the later one goes in chained onto what is stored."""
    with audit_target.engine.begin() as conn:
        conn.exec_driver_sql(REFUSE)
    guard = ChainGuard(KEY)
    meanwhile, made = _chain_ahead(guard, later := _rows(range(5, 9)))
    with pytest.raises(IntegrityError):
        append(audit_target.engine, _rows(range(5)), KEY, guard, meanwhile=meanwhile)
    assert made[0] is not None and made[0].head.seq == 5
    result = append(audit_target.engine, later, KEY, guard, early=made[0])
    assert not result.chained_ahead and result.written == 4
    assert audit_target.count() == 4 and verify_chain(audit_target.engine, key=KEY).ok


def test_the_writer_stores_each_batch_after_the_first_as_chained_ahead(audit_target, audit_redis):
    audit_redis.publish([make_record(i) for i in range(20)])
    stats = _run_writer(audit_target, audit_redis, batch_size=3)
    assert (stats.rows_written, stats.chained_ahead, stats.duplicates) == (20, 6, 0)
    assert audit_target.count() == 20 and audit_redis.pending() == 0
    assert verify_chain(audit_target.engine, key=KEY).ok


def test_the_usage_the_writer_kept_adds_up_to_the_rollup_of_every_row(
    audit_target, audit_redis, monkeypatch
):
    """Refreshes that add the cells the writer kept of its own rows (chaining.Known)
    instead of reading the rows back give the cells a rebuild from every row makes:
    adapters, tenants (one with a NUL, one none), two completions, errors, latencies."""
    rng = random.Random(7)
    adapters = [None] + [make_adapter(f"lora-{k}", k) for k in range(1, 4)]
    records = [
        make_record(
            i,
            adapter=rng.choice(adapters),
            tenant=rng.choice(["acme", None, "n\0l"]),
            n=rng.choice([1, 2]),
            arrival=1_700_000_000 + rng.uniform(0, 4 * 86_400),
            latency=10 ** rng.uniform(-2, 1),
            finish_reason=rng.choice(["stop", "length", "error"]),
        )
        for i in range(60)
    ]
    read_back, real = [], rollup.rows_between

    def rows_between(conn, after, upto=None):
        read_back.append(upto - after)
        return real(conn, after, upto)

    monkeypatch.setattr(rollup, "rows_between", rows_between)
    audit_redis.publish(records)
    stats = _run_writer(audit_target, audit_redis, batch_size=4, rollup_rows=8)
    rows = sum(len(r["outputs"]) for r in records)
    # of 15 batches, the first and any with an adapter not stored yet are chained in turn
    assert stats.rows_written == rows and stats.chained_ahead >= 10

    def cells():
        with audit_target.engine.connect() as conn:
            found = conn.execute(select(usage_daily)).mappings().all()
        return {(r["day"], r["dimension"], r["group_key"]): dict(r) for r in found}

    kept = cells()
    # the first refresh read its rows back (the first batch is not chained ahead);
    # the later ones added what the writer kept
    assert len(read_back) > 3 and sum(read_back) < rows / 3
    with write_transaction(audit_target.engine) as conn:
        rollup.rebuild(conn)
    assert kept == cells()
    assert sum(cell["requests"] for cell in kept.values()) == 2 * len(records)


def test_two_writers_at_once_store_every_row_once_in_one_chain(audit_target, audit_redis):
    """Two writers (as two replicas would) drain one stream at once: each chains its
    next batch onto its own rows being inserted, the other's rows move the head under
    it, so its chains ahead are redone when they no longer hold and its kept usage is
    read back instead; every row is stored once, the chain verifies and the rollup is
    the rollup of every row."""
    rng = random.Random(11)
    records = [
        make_record(i, tenant=rng.choice(["acme", "globex", None]), n=rng.choice([1, 2]))
        for i in range(300)
    ]
    audit_redis.publish(records)
    layout = {"prefix": audit_redis.prefix, "shards": audit_redis.shards}
    writers = [
        AuditWriter(
            audit_redis.conn,
            audit_target.engine,
            WriterConfig(**layout, consumer=f"w-{k}", batch_size=7, rollup_rows=20, **FAST_WRITER),
        )
        for k in range(2)
    ]
    stats, together = [], threading.Barrier(2)

    def run(writer):
        together.wait(10)  # both read their first batch at once
        stats.append(writer.run(burst=True))

    threads = [threading.Thread(target=run, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    rows = sum(len(r["outputs"]) for r in records)
    assert len(stats) == 2 and sum(s.rows_written for s in stats) == rows
    assert all(s.rows_written for s in stats)  # both took part
    assert audit_target.count() == rows and audit_redis.pending() == 0
    assert verify_chain(audit_target.engine, key=KEY).ok

    def cells(conn):
        found = conn.execute(select(usage_daily)).mappings().all()
        return {(r["day"], r["dimension"], r["group_key"]): dict(r) for r in found}

    with write_transaction(audit_target.engine) as conn:
        rollup.refresh(conn, rows)  # what is left after the last refresh
        refreshed = cells(conn)
        rollup.rebuild(conn)
        assert refreshed and refreshed == cells(conn)
