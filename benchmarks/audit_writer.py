"""Sustained throughput of the audit writer, on SQLite and on PostgreSQL.

Fills ``{p}:audit`` with N realistic records (a few hundred bytes of prompt and
output, 64 output tokens, a mix of adapters and tenants), then lets one or
more writers drain it and reports rows/s over the whole drain, with progress
every second. Everything it makes is removed at the end (Redis keys, the
PostgreSQL schema, the SQLite file).

    .venv/bin/python benchmarks/audit_writer.py --db sqlite --db postgresql \
        --redis-url redis://127.0.0.1:6379/0 \
        --pg-url postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
import uuid

import orjson
import redis
from sqlalchemy import create_engine, text

from lorapool.audit_db import (
    AuditWriter,
    DatabaseConfig,
    WriterConfig,
    create_audit_engine,
    migrate,
    verify_chain,
)
from lorapool.audit_db.writer_config import own_the_collector
from lorapool.lifecycle.keys import Keys
from lorapool.records.audit import sign_record
from lorapool.signing import key_from_env

# Records are signed as a worker signs them (the writer checks every signature):
# with $LORAPOOL_AUDIT_KEY when set, else a benchmark key.
KEY = key_from_env() or b"lorapool-benchmark-audit-key-0123456789"

WORDS = "select from where the adapter answered with a short and polite reply".split()  # noqa: SIM905


def _adapter(i: int) -> dict | None:
    if i % 4 == 0:
        return None
    k = i % 4
    return {
        "name": f"lora-{k}",
        "id": k,
        "path": f"/adapters/lora-{k}",
        "sha256": f"{k:x}" * 64,
        "rank": 16,
        "alpha": 32.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "base_model": "SmolLM2-135M-Instruct",
    }


def make_record(i: int, run: str, pool: str) -> bytes:
    now = time.time()
    text_out = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(40))
    record = {
        "v": 1,
        "request_id": f"{run}-{i}",
        "prompt": text_out[:300] + "?",
        "prompt_token_ids": list(range(i % 7, i % 7 + 64)),
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "n": 1},
        "metadata": {"tenant": f"tenant-{i % 5}"},
        "worker": "bench-worker",
        "base_model": {"name": "SmolLM2-135M-Instruct", "sha256": "e" * 64},
        "adapter": _adapter(i),
        "metrics": {
            "arrival_time": now - 2,
            "first_scheduled_time": now - 1.9,
            "first_token_time": now - 1.8,
            "last_token_time": now,
            "finished_time": now,
            "queue_time": 0.1,
            "num_prompt_tokens": 64,
            "num_generated_tokens": 64,
        },
        "outputs": [
            {
                "index": 0,
                "text": text_out,
                "token_ids": list(range(i, i + 64)),
                "cumulative_logprob": -12.5,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "error": None,
    }
    return orjson.dumps(sign_record(record, KEY, pool))


def fill(conn: redis.Redis, keys: Keys, count: int, run: str) -> None:
    for start in range(0, count, 2000):
        pipe = conn.pipeline(transaction=False)
        for i in range(start, min(start + 2000, count)):
            pipe.xadd(keys.audit, {"data": make_record(i, run, keys.prefix)})
        pipe.execute()


def _progress(label: str, writers: list[AuditWriter], total: int, done: threading.Event):
    start = last_time = time.monotonic()
    last_rows = 0
    while not done.wait(1.0):
        rows, now = sum(w.stats.rows_written for w in writers), time.monotonic()
        print(
            f"  {label}: {rows:>8,}/{total:,} rows  {(rows - last_rows) / (now - last_time):>8,.0f}"
            f" rows/s now  {rows / (now - start):>8,.0f} rows/s overall",
            file=sys.stderr,
        )
        last_rows, last_time = rows, now


def drain(label: str, conn, config: DatabaseConfig, keys: Keys, args) -> float:
    engines = [create_audit_engine(config) for _ in range(args.writers)]
    writers = [
        AuditWriter(
            conn,
            engine,
            WriterConfig(
                prefix=keys.prefix,
                consumer=f"bench-{k}",
                batch_size=args.batch_size,
                prefetch=args.prefetch,
                audit_key=KEY,
            ),
        )
        for k, engine in enumerate(engines)
    ]
    done = threading.Event()
    threading.Thread(
        target=_progress, args=(label, writers, args.records, done), daemon=True
    ).start()
    if args.own_gc:
        own_the_collector()  # as `lorapool audit-writer` does
    start, cpu = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=w.run, kwargs={"burst": True}) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    done.set()
    report = verify_chain(engines[0], key=KEY)
    rows = sum(w.stats.rows_written for w in writers)
    assert rows == args.records and report.ok and report.num_rows == rows, (rows, report)
    for engine in engines:
        engine.dispose()
    # the writers' CPU (this process: parse, sign checks, hashing, encoding): on a
    # loaded machine a steadier figure than the rate, which also waits for cores
    print(f"  {label}: writer CPU {cpu / rows * 1e6:,.0f} µs a row", file=sys.stderr)
    return rows / elapsed


@contextlib.contextmanager
def database(kind: str, pg_url: str | None):
    if kind == "sqlite":
        with tempfile.TemporaryDirectory() as folder:
            yield DatabaseConfig(url=f"sqlite:///{folder}/audit.sqlite")
        return
    schema = f"lorapool_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(pg_url)
    with admin.begin() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield DatabaseConfig(url=pg_url, schema=schema)
    finally:
        with admin.begin() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def bench(kind: str, conn: redis.Redis, args) -> float:
    run = uuid.uuid4().hex[:8]
    keys = Keys(f"bench-{run}")
    try:
        with database(kind, args.pg_url) as config:
            engine = create_audit_engine(config)
            migrate(engine)
            engine.dispose()
            print(f"{kind}: filling {keys.audit} with {args.records:,} records", file=sys.stderr)
            fill(conn, keys, args.records, run)
            return drain(kind, conn, config, keys, args)
    finally:
        for key in conn.scan_iter(match=f"{keys.prefix}:*"):
            conn.delete(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", action="append", choices=["sqlite", "postgresql"])
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--writers", type=int, default=1)
    parser.add_argument(
        "--no-prefetch", dest="prefetch", action="store_false", help="the writer's prefetch off"
    )
    parser.add_argument(
        "--default-gc",
        dest="own_gc",
        action="store_false",
        help="keep Python's collector settings (the CLI writer freezes and tunes them)",
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
    conn = redis.Redis.from_url(args.redis_url)
    results = {kind: bench(kind, conn, args) for kind in args.db or ["sqlite", "postgresql"]}
    print(
        f"\nrecords {args.records:,}, batch {args.batch_size}, writers {args.writers}, "
        f"prefetch {args.prefetch}, own gc {args.own_gc}, cpus {os.cpu_count()}"
    )
    for kind, rate in results.items():
        print(f"{kind:>10}: {rate:,.0f} rows/s")


if __name__ == "__main__":
    main()
