"""The audit writer's CPU a row, its own and its database backends': the measure that
still tells two versions apart on a loaded two-core machine, where rows/s follows the
load (RESULTS.md, helper 71: whole-fill rates of one code varied 1.5x at load 3-8).

``--rows`` ``audit_scale`` records are put on a stream of their own first (``--pre``
more are drained before, untimed), then one ``AuditWriter`` drains them into a fresh
schema (``--into``: a kept one; scattered arrivals into a filled schema need
``--first`` N, its number of records, or every record repeats a stored one). Reported:
rows/s, wall a row, the writer process's CPU a row (``time.process_time``), the CPU a
row of the server backends connected to the schema's database (``/proc/<pid>/stat``:
'-' when the server is not on this machine; the database should be the benchmark's
own, or other sessions' backends count too), the load average. Run it from a base's
and a head's checkout in turn, alternated. A fresh schema and the Redis keys are
removed at the end.

    .venv/bin/python benchmarks/_audit_writer_cpu.py --rows 20000 \
        --pg-url postgresql+psycopg://postgres@127.0.0.1:5432/bench71
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

import redis
from sqlalchemy import create_engine, make_url, text

sys.path.insert(0, os.path.dirname(__file__))
from audit_scale import KEY, backends_cpu_s, feed  # noqa: E402

from lorapool.audit_db import (  # noqa: E402
    AuditWriter,
    DatabaseConfig,
    WriterConfig,
    create_audit_engine,
    migrate,
)
from lorapool.audit_db.writer_config import own_the_collector  # noqa: E402
from lorapool.lifecycle.keys import Keys  # noqa: E402


def drain(writer: AuditWriter, rows: int) -> None:
    while writer.stats.rows_written < rows:
        writer.step(block=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="records drained, timed")
    parser.add_argument("--pre", type=int, default=0, help="records drained first, untimed")
    parser.add_argument("--no-prefetch", action="store_true")
    parser.add_argument("--batch", type=int, default=WriterConfig.batch_size, help="batch size")
    parser.add_argument(
        "--into", help="drain into this schema (a filled one, kept) instead of a fresh one"
    )
    parser.add_argument(
        "--in-order-of",
        type=int,
        default=0,
        help="arrivals in time order after N rows (audit_scale --in-order --rows N); "
        "the records are numbered from N",
    )
    parser.add_argument(
        "--first",
        type=int,
        default=0,
        help="number the records from this one (scattered arrivals into a schema that "
        "already holds records 0..N-1: give N, or every record is a duplicate)",
    )
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument(
        "--pg-url",
        default=os.environ.get(
            "LORAPOOL_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    args = parser.parse_args()
    if args.in_order_of and not args.into:
        parser.error("--in-order-of goes on from a filled schema: name it with --into")
    if args.in_order_of and args.first:
        parser.error("--in-order-of numbers the records from N already: no --first")
    run = uuid.uuid4().hex[:8]
    schema, keys = args.into or f"bench_writer_cpu_{run}", Keys(f"bench-writer-cpu-{run}")
    admin = create_engine(args.pg_url)
    database = make_url(args.pg_url).database
    if not args.into:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine = create_audit_engine(DatabaseConfig(url=args.pg_url, schema=schema))
    conn = redis.Redis.from_url(args.redis_url)
    try:
        migrate(engine)
        config = WriterConfig(
            prefix=keys.prefix,
            consumer="cpu",
            audit_key=KEY,
            prefetch=not args.no_prefetch,
            batch_size=args.batch,
        )
        writer = AuditWriter(conn, engine, config)
        writer.ensure_group()
        own_the_collector()  # as `lorapool audit-writer` does
        end, total = time.time(), args.pre + args.rows
        first = args.in_order_of or args.first
        order = {"in_order_of": args.in_order_of}
        if args.in_order_of:  # the filled schema's fill ended where its newest row is
            with engine.connect() as c:
                end = c.execute(text("SELECT max(arrival_time) FROM completions")).scalar()
        feed_to = (args.redis_url, keys.audit, keys.prefix)
        if args.pre:
            feed(*feed_to, first, first + args.pre, end, 90.0, args.pre, **order)
            drain(writer, args.pre)
        feed(*feed_to, first + args.pre, first + total, end, 90.0, total, **order)
        load = os.getloadavg()[0]
        server, cpu = backends_cpu_s(admin, database), time.process_time()
        began = time.perf_counter()
        drain(writer, total)
        wall = time.perf_counter() - began
        cpu, ended = time.process_time() - cpu, backends_cpu_s(admin, database)
        n = writer.stats.rows_written - args.pre
        server = "-" if None in (server, ended) else f"{1e6 * (ended - server) / n:.0f}"
        print(
            f"rows/s {n / wall:,.0f}  wall {1e6 * wall / n:.0f} µs a row  "
            f"writer CPU {1e6 * cpu / n:.0f}  server CPU {server}  "
            f"load {load:.2f} -> {os.getloadavg()[0]:.2f}"
            + f"  batches chained ahead {getattr(writer.stats, 'chained_ahead', '-')}"
        )
    finally:
        engine.dispose()
        if not args.into:
            with admin.begin() as c:
                c.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
        for key in conn.scan_iter(match=keys.pattern):
            conn.delete(key)


if __name__ == "__main__":
    main()
