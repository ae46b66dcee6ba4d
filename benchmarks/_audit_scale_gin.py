"""What the trigram index costs the audit write path: ``store.append`` (the writer's
store path, without Redis) of N fresh rows into a new migrated schema, with and without
the ``gin_trgm_ops`` index on ``completions.text``, alternating for two rounds (one
``ChainGuard`` for a run, as the writer keeps one).

    .venv/bin/python benchmarks/_audit_scale_gin.py 10000
"""

import os
import sys
import time
import uuid

from sqlalchemy import create_engine, text

sys.path.insert(0, os.path.dirname(__file__))
from audit_scale import KEY, make_record  # noqa: E402

from lorapool.audit_db import DatabaseConfig, create_audit_engine, migrate  # noqa: E402
from lorapool.audit_db.guard import ChainGuard  # noqa: E402
from lorapool.audit_db.rows import prepare  # noqa: E402
from lorapool.audit_db.store import append  # noqa: E402
from lorapool.records.audit import parse_record  # noqa: E402

URL = os.environ.get("LORAPOOL_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
GIN = (
    "SELECT indexname FROM pg_indexes WHERE schemaname = :s AND tablename = 'completions' "
    "AND indexdef LIKE '%gin_trgm_ops%'"
)


def one_run(admin, batches, n: int, gin: bool) -> str:
    schema = f"bench_gin_{uuid.uuid4().hex[:8]}"
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        engine = create_audit_engine(DatabaseConfig(url=URL, schema=schema))
        migrate(engine)
        if not gin:
            with engine.begin() as conn:
                for name in conn.execute(text(GIN), {"s": schema}).scalars().all():
                    conn.execute(text(f'DROP INDEX "{schema}"."{name}"'))
        guard = ChainGuard(KEY)  # one for the run, as a writer keeps one (a fresh one a
        start, cpu = time.perf_counter(), time.process_time()  # call re-verifies)
        for batch in batches:
            append(engine, batch, KEY, guard)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        engine.dispose()
        return (
            f"gin={gin}: {n / wall:,.0f} rows/s, Python {cpu / n * 1e6:.0f} µs a row, "
            f"PostgreSQL and waits {(wall - cpu) / n * 1e6:.0f} µs a row"
        )
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    now, batches = time.time(), []
    for first in range(0, n, 500):
        made = [make_record(i, now, 90, "p") for i in range(first, first + 500)]
        records = [parse_record(m, key=KEY, pool="p") for m in made]
        batches.append([row for record in records for row in prepare(record, "p")])
    admin = create_engine(URL)
    for round_ in range(2):
        for gin in (True, False):
            print(f"round {round_} {one_run(admin, batches, n, gin)}", flush=True)
    admin.dispose()


if __name__ == "__main__":
    main()
