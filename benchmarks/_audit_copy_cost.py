"""Where PostgreSQL's time goes in the audit writer's COPY, a row at a time: a scratch
schema (migrated, every index) filled with ``audit_scale``-like rows by COPY in
batches of 500, each its own transaction as the writer's are, reporting per window
the wall time, the server backend's CPU (from ``/proc``: the server must run on this
machine) and the WAL a row. Then each ``--variant`` statement (``{gin}`` is the
partition's trigram index, ``{part}`` the partition) and two windows after it, so
what one index or setting costs is read off the same table at the same size.

    .venv/bin/python benchmarks/_audit_copy_cost.py --rows 200000 \
        --variant "DROP INDEX ix_completions_text_trgm" --variant "DROP INDEX ..."

No writer, Redis or chain here: the rows are made once from 2,000 prepared records
(ids, texts and arrival times varied per row) so that the Python side costs little.
The schema is dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from sqlalchemy import text

sys.path.insert(0, os.path.dirname(__file__))
from audit_scale import KEY, make_record  # noqa: E402

from lorapool.audit_db import (  # noqa: E402
    DatabaseConfig,
    bulk,
    chaining,
    create_audit_engine,
    decoder,
    migrate,
    partitions,
    store,
)
from lorapool.audit_db.rows import prepare  # noqa: E402

URL = os.environ.get("LORAPOOL_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
GIN = (
    "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema() "
    "AND tablename LIKE 'completions_p%' AND indexdef LIKE '%gin_trgm%'"
)


class Rows:
    """COPY text of fresh rows, 500 at a time, varied from a few prepared ones."""

    def __init__(self, engine, period: int, now: float):
        made = [decoder.parse(make_record(i, now, 90, "p"), key=KEY, pool="p") for i in range(2000)]
        self.rows = [row for record in made for row in prepare(record, "p")]
        with engine.begin() as conn:
            self.pks = store._adapter_pks(conn, self.rows, {})
        self.period, self.now, self.seq, self.rng = period, now, 0, random.Random(1)

    def batch(self, n: int = 500) -> bytes:
        out = []
        for _ in range(n):
            self.seq += 1
            row = self.rows[self.seq % len(self.rows)]
            pk = self.pks[row.adapter["fingerprint"]] if row.adapter else None
            values = chaining.stored_values(
                row, self.seq, "0" * 64, f"{self.seq:064x}", pk, self.period
            )
            values["request_id"] = f"r-{self.seq}"
            values["text"] = values["text"].rsplit(" ", 1)[0] + f" #{self.seq}"
            values["arrival_time"] = self.now - self.rng.random() * 90 * 86_400
            out.append(values)
        return bulk._SIGNATURE + bulk._copy_binary(out) + bulk._TRAILER  # as bulk_insert sends


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def window(engine, rows: Rows, batches: int, label: str) -> None:
    """COPY ``batches`` batches (made beforehand) and print what a row cost."""
    raw = engine.raw_connection()
    conn = raw.driver_connection
    cur = conn.cursor()
    pid = cur.execute("SELECT pg_backend_pid()").fetchone()[0]
    lsn = cur.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    conn.commit()
    data = [rows.batch() for _ in range(batches)]
    cpu, start, commit = _cpu_s(pid), time.perf_counter(), 0.0
    for chunk in data:
        with cur.copy(bulk._COPY) as copy:
            copy.write(chunk)
        began = time.perf_counter()
        conn.commit()
        commit += time.perf_counter() - began
    wall, cpu = time.perf_counter() - start, _cpu_s(pid) - cpu
    wal = cur.execute("SELECT pg_current_wal_lsn() - %s::pg_lsn", (lsn,)).fetchone()[0]
    conn.commit()
    raw.close()
    n = batches * 500
    print(
        f"{label[:40]:40s} at {rows.seq:>9,} rows: wall {wall / n * 1e6:4.0f} µs a row "
        f"(commit {commit / n * 1e6:3.0f}), server CPU {cpu / n * 1e6:4.0f} µs, "
        f"WAL {int(wal) / n:5.0f} B, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="fill to this many first")
    parser.add_argument("--window", type=int, default=10_000, help="rows a line reports")
    parser.add_argument("--variant", action="append", default=[], help="SQL, then 2 windows")
    parser.add_argument("--schema", default=f"bench_copy_cost_{os.getpid()}")
    args = parser.parse_args()
    admin = create_audit_engine(DatabaseConfig(url=URL))
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{args.schema}"'))
    try:
        engine = create_audit_engine(DatabaseConfig(url=URL, schema=args.schema))
        migrate(engine)
        now = time.time()
        period = partitions.period_of(now)
        with engine.begin() as conn:
            partitions.ensure(conn, period)
        rows, batches = Rows(engine, period, now), max(args.window // 500, 1)
        while rows.seq < args.rows:
            window(engine, rows, batches, "every index")
        for statement in args.variant:
            with engine.begin() as conn:
                gin = conn.execute(text(GIN)).scalar()
                part = f"{partitions.PARTITION_PREFIX}{period}"
                conn.execute(text(statement.replace("{gin}", str(gin)).replace("{part}", part)))
            for _ in range(2):
                window(engine, rows, batches, statement)
        engine.dispose()
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{args.schema}" CASCADE'))
        admin.dispose()


if __name__ == "__main__":
    main()
