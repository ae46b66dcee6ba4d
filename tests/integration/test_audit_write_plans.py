"""The audit write path on PostgreSQL reads by index, whatever the statistics say.

A partition nobody has analyzed (a server without autovacuum; every new month until
autovacuum gets to it) gives the planner no statistics: it then takes an equality
for 0.5% of the rows and an open range for a third. The writer's key look-up of a
batch (500 ids) and its row count after the COPY (``seq > head``) were planned as
scans of the whole partition: each batch read the table, and the write rate fell as
the table grew (benchmarks/RESULTS.md, issue 34, helper 55). Here every statement
the writer sends on ``completions`` during a batch is explained, as sent and in its
transaction, on an unanalyzed partition: no sequential scan of a partition, no JIT.
"""

import uuid

import orjson
import pytest
from audit_fixtures import KEY, make_adapter, make_record, pg_base_url
from sqlalchemy import create_engine, event, text

from lorapool.audit_db import DatabaseConfig, create_audit_engine, migrate
from lorapool.audit_db.guard import ChainGuard
from lorapool.audit_db.store import append, prepare
from lorapool.records.audit import record_from_dict

pytestmark = pytest.mark.integration
BATCH = 200


@pytest.fixture
def pg_engine():
    url = pg_base_url()
    if url is None:
        pytest.skip("LORAPOOL_TEST_PG_URL is not set")
    schema = f"lorapool_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine = create_audit_engine(DatabaseConfig(url=url, schema=schema))
    migrate(engine)
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def _batch(first: int) -> list:
    adapters = [make_adapter("sql-lora", 1, 1), make_adapter("chat-lora", 2, 1)]
    records = [
        record_from_dict(make_record(i, adapter=adapters[i % 2]))
        for i in range(first, first + BATCH)
    ]
    return [row for record in records for row in prepare(record, "p")]


def _plans_of_one_batch(engine, guard: ChainGuard, first: int) -> list[tuple[str, dict]]:
    """(statement, its plan) of each SELECT on completions of one batch's transaction."""
    plans = []

    def explain(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("SELECT") and "completions" in statement:
            found = cursor.connection.execute(f"EXPLAIN (FORMAT JSON) {statement}", parameters)
            plans.append((statement, found.fetchone()[0][0]))

    event.listen(engine, "after_cursor_execute", explain)
    try:
        result = append(engine, _batch(first), KEY, guard)
    finally:
        event.remove(engine, "after_cursor_execute", explain)
    assert result.written == BATCH
    return plans


def _nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def test_a_batch_reads_an_unanalyzed_partition_by_index_only(pg_engine):
    guard = ChainGuard(KEY)
    for first in range(0, 3000, BATCH):  # 3,000 rows: a sequential scan now looks cheaper
        append(pg_engine, _batch(first), KEY, guard)  # than 200 look-ups of 0.5% each
    with pg_engine.connect() as conn:
        analyzed = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_user_tables WHERE schemaname = current_schema() "
                "AND relname LIKE 'completions_p%' AND last_analyze IS NOT NULL"
            )
        ).scalar()
    assert analyzed == 0  # the planner has no statistics to go on
    plans = _plans_of_one_batch(pg_engine, guard, 3000)
    assert len(plans) >= 3  # the key look-up, the chain head, the count after the COPY
    for statement, plan in plans:
        scans = [
            n["Relation Name"]
            for n in _nodes(plan["Plan"])
            if n["Node Type"] == "Seq Scan" and n["Relation Name"].startswith("completions_p")
        ]
        assert not scans, f"{statement[:120]} scans {scans}: {orjson.dumps(plan).decode()[:2000]}"
        assert "JIT" not in plan


def test_the_write_transaction_runs_without_jit(pg_engine):
    from lorapool.audit_db.database import write_transaction

    with write_transaction(pg_engine) as conn:
        assert conn.execute(text("SELECT current_setting('jit')")).scalar() == "off"
    with pg_engine.connect() as conn:  # the setting is the transaction's alone
        assert conn.execute(text("SELECT current_setting('jit')")).scalar() == "on"
