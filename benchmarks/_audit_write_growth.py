"""Where the audit write path's time goes as the table grows: ``store.append`` (the
writer's store path, without Redis) of ``benchmarks/audit_scale.py``'s records into a
new schema in batches of 500, one ``ChainGuard``; per window of rows, the rate and
the wall time of each statement a row (SQLAlchemy cursor events; the COPY timed
around ``bulk_insert``). ``--explain-at`` prints EXPLAIN (ANALYZE, BUFFERS) of the
last SELECT of each kind, as sent, after that many rows. The schema is dropped at
the end unless ``--keep``.

    .venv/bin/python benchmarks/_audit_write_growth.py --rows 200000 --window 10000
"""

import argparse
import collections
import os
import sys
import time
import uuid

from sqlalchemy import create_engine, event, text

sys.path.insert(0, os.path.dirname(__file__))
from audit_scale import KEY, make_record  # noqa: E402

from lorapool.audit_db import DatabaseConfig, create_audit_engine, migrate, store  # noqa: E402
from lorapool.audit_db.guard import ChainGuard  # noqa: E402
from lorapool.audit_db.rows import prepare  # noqa: E402
from lorapool.records.audit import parse_record  # noqa: E402

URL = os.environ.get("LORAPOOL_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _timed(engine, times: dict, last: dict) -> None:
    @event.listens_for(engine, "before_cursor_execute")
    def before(conn, cursor, statement, parameters, context, executemany):
        conn.info["t0"] = time.perf_counter()

    @event.listens_for(engine, "after_cursor_execute")
    def after(conn, cursor, statement, parameters, context, executemany):
        if not statement.startswith("EXPLAIN"):
            kind = " ".join(statement.split())[:40]
            times[kind] += time.perf_counter() - conn.info["t0"]
            last[kind] = (statement, parameters)

    copy = store.bulk_insert

    def timed_copy(conn, rows, meanwhile=None):
        start = time.perf_counter()
        try:
            return copy(conn, rows, meanwhile)
        finally:
            times["COPY"] += time.perf_counter() - start

    store.bulk_insert = timed_copy


def _explain(engine, last: dict, size: int) -> None:
    print(f"=== EXPLAIN after {size:,} rows", flush=True)
    with engine.connect() as conn:
        for kind, (statement, parameters) in list(last.items()):
            if statement.lstrip().upper().startswith("SELECT"):
                plan = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS) {statement}", parameters)
                print(f"-- {kind}\n" + "\n".join("   " + line for line in plan.scalars()))


def _batches(first: int, window: int, now: float) -> list:
    batches = []
    for start in range(first, first + window, 500):
        made = [make_record(i, now, 90, "p") for i in range(start, start + 500)]
        records = [parse_record(m, key=KEY, pool="p") for m in made]
        batches.append([row for record in records for row in prepare(record, "p")])
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--window", type=int, default=10_000)
    parser.add_argument("--explain-at", type=int, action="append", default=[])
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    schema = f"bench_growth_{uuid.uuid4().hex[:8]}"
    admin = create_engine(URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        engine = create_audit_engine(DatabaseConfig(url=URL, schema=schema))
        migrate(engine)
        times, last = collections.defaultdict(float), {}
        _timed(engine, times, last)
        guard, now, done = ChainGuard(KEY), time.time(), 0
        while done < args.rows:
            batches = _batches(done, args.window, now)
            times.clear()
            start = time.perf_counter()
            for batch in batches:
                store.append(engine, batch, KEY, guard)
            wall, done = time.perf_counter() - start, done + args.window
            top = sorted(times.items(), key=lambda kv: -kv[1])[:5]
            pieces = "; ".join(f"{k} {v / args.window * 1e6:.0f}" for k, v in top)
            print(
                f"{done:>9,} rows: {args.window / wall:6,.0f} rows/s, load "
                f"{os.getloadavg()[0]:.1f} | µs a row: {pieces}",
                flush=True,
            )
            if done in args.explain_at:
                _explain(engine, last, done)
        engine.dispose()
    finally:
        if not args.keep:
            with admin.begin() as conn:
                conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


if __name__ == "__main__":
    main()
