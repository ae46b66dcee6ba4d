"""The writer's work while PostgreSQL inserts a batch (bulk.py's ``meanwhile``): it runs
after the COPY is ended and before its answer is read, so the server inserts while the
writer parses its next batch; a failure on either side leaves the connection usable
and nothing half-stored. PostgreSQL only (SQLite inserts in the writer's process)."""

import pytest
from audit_fixtures import FAST_WRITER, KEY, make_record
from sqlalchemy import create_engine, event, text
from sqlalchemy.exc import IntegrityError

from lorapool.audit_db import AuditWriter, WriterConfig, verify_chain
from lorapool.audit_db.rows import prepare
from lorapool.audit_db.store import append
from lorapool.audit_record import record_from_dict
from lorapool.lifecycle.dead_letter import decode_dead_letter

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
    config = WriterConfig(
        prefix=audit_redis.prefix,
        shards=audit_redis.shards,
        consumer="w-ahead",
        batch_size=2,
        **FAST_WRITER,
    )
    stats = AuditWriter(audit_redis.conn, audit_target.engine, config).run(burst=True)
    assert (stats.rows_written, stats.dead_lettered, stats.duplicates) == (8, 1, 0)
    (letter,) = [decode_dead_letter(fields) for _id, fields in audit_redis.dead()]
    assert "refused by a test" in letter.reason
    assert audit_target.count() == 8 and audit_redis.pending() == 0
    assert verify_chain(audit_target.engine, key=KEY).ok
