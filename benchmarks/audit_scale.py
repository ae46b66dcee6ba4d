"""The audit trail at compliance scale: PostgreSQL filled through the audit writer,
then every query, verify, export and the bytes a row takes (issue 34).

A feeder process signs realistic records (500 adapters, 50 tenants, arrivals over
90 days, ~600-character prompt and output, 256 prompt and 192 output tokens; texts
and token ids from 1,000 templates, so the feeder stays cheap next to the writer) onto
``{p}:audit`` while one ``AuditWriter`` drains it into a schema of its own; the rate,
and the CPU a row of the writer and of its PostgreSQL backends (when the server runs
on this machine), are taken over the first and the last 30,000 rows. Then, each in
process (median wall time, time in SQL, peak memory), through the CLI (a process of its own: wall
time, peak RSS) and over HTTP (``lorapool serve``): a request by id, one adapter's
first page over 7 days, usage over 30 days, a text search in a 7-day window; full
and incremental verify (a day's rows: 1/90 of the table); CSV exports of 100k rows
and of every row; bytes per row, compact rows against JSON token ids.

    .venv/bin/lorapool bench audit_scale --rows 1000000 --json out.json

Targets at 1M rows: interactive queries <= 200 ms in SQL and <= 1 s through the CLI,
incremental verify of a day's rows <= 2 s, export peak <= 100 MB, writer >= 5,000
rows/s. Everything it makes is removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import random
import sys
import tempfile
import time
import uuid

import orjson
import redis
from sqlalchemy import create_engine, make_url, text

sys.path.insert(0, os.path.dirname(__file__))
from _audit_scale_queries import bytes_per_row, queries, verify_and_export  # noqa: E402

from lorapool.audit_db import (  # noqa: E402  # noqa: E402
    AuditWriter,
    DatabaseConfig,
    WriterConfig,
    create_audit_engine,
    migrate,
    store,  # noqa: E402
)
from lorapool.audit_db.writer_config import own_the_collector  # noqa: E402
from lorapool.lifecycle.keys import Keys  # noqa: E402
from lorapool.records.audit import sign_record  # noqa: E402
from lorapool.signing import key_from_env  # noqa: E402

KEY = key_from_env() or b"lorapool-benchmark-audit-key-0123456789"
DAY = 86_400.0
WORDS = (  # noqa: SIM905 (a sentence reads better than a list of strings)
    "select from where the adapter answered with a short and polite reply about "
    "tables rows indexes keys joins plans costs buffers pages tuples"
).split()
AHEAD = 20_000  # records the feeder keeps in the stream ahead of the writer
WINDOW = 30_000  # rows the writer's rate is taken over, at the start and at the end
DEFAULT_GC = gc.get_threshold()
NEEDLE = "zebracorn"  # in one output text in 5,000


TEMPLATES = 1000  # distinct prompts, outputs and token lists (made once; cheap to feed)


def _template(k: int) -> dict:
    rng = random.Random(k)
    words = " ".join(rng.choice(WORDS) for _ in range(100))
    return {
        "prompt": words[::-1][:600],
        "prompt_token_ids": [rng.randrange(49152) for _ in range(256)],
        "text": words[:560],
        "token_ids": [rng.randrange(49152) for _ in range(192)],
        "latency": 0.5 + rng.expovariate(0.5),
        "logprob": -rng.uniform(10, 90),
        "finish": rng.choice(["stop", "stop", "length", "error"]),
    }


_TEMPLATES: list[dict] = []


def make_record(i: int, end: float, days: float, pool: str, in_order_of: int = 0) -> bytes:
    """Record ``i``: a template's texts and tokens, its own id, time, adapter and tenant.
    Arrivals are scattered over ``days`` (the default: every time index takes inserts
    all over); ``in_order_of`` N: record i arrives at i/N of the way, as a writer
    meets them in service."""
    if not _TEMPLATES:
        _TEMPLATES.extend(_template(k) for k in range(TEMPLATES))
    t = _TEMPLATES[i % TEMPLATES]
    spread = (i * 2654435761) % 2**32 / 2**32  # a fixed scatter of i over [0, 1)
    if in_order_of:
        spread = 1 - i / in_order_of
    adapter = (i * 40503) % 500
    arrival = end - spread * days * DAY
    answer = t["text"] + (f" {NEEDLE}{i}" if i % 5000 == 7 else f" #{i}")
    record = {
        "v": 1,
        "request_id": f"r-{i}",
        "prompt": t["prompt"],
        "prompt_token_ids": t["prompt_token_ids"],
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 192, "n": 1},
        "metadata": {"tenant": f"tenant-{(i * 7919) % 50}"},
        "worker": f"worker-{i % 8}",
        "base_model": {"name": "SmolLM2-135M-Instruct", "sha256": "e" * 64},
        "adapter": None
        if adapter == 0
        else {
            "name": f"lora-{adapter}",
            "id": adapter,
            "path": f"/adapters/lora-{adapter}/v1",
            "sha256": f"{adapter:064x}",
            "rank": 16,
            "alpha": 32.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "base_model": "SmolLM2-135M-Instruct",
        },
        "metrics": {
            "arrival_time": arrival,
            "first_scheduled_time": arrival + 0.05,
            "first_token_time": arrival + 0.2,
            "last_token_time": arrival + 2.5,
            "finished_time": arrival + t["latency"],
            "queue_time": 0.05,
            "num_prompt_tokens": 256,
            "num_generated_tokens": 192,
        },
        "outputs": [
            {
                "index": 0,
                "text": answer,
                "token_ids": t["token_ids"],
                "cumulative_logprob": t["logprob"],
                "finish_reason": t["finish"],
                "stop_reason": None,
            }
        ],
        "error": None,
    }
    return orjson.dumps(sign_record(record, KEY, pool))


def feed(redis_url, stream, pool, start: int, stop: int, end, days, ahead: int, in_order_of=0):
    """Records ``start..stop`` onto ``stream``, keeping at most ``ahead`` unread there."""
    conn = redis.Redis.from_url(redis_url)
    i = start
    while i < stop:
        if conn.xlen(stream) > ahead:
            time.sleep(0.05)
            continue
        pipe = conn.pipeline(transaction=False)
        for k in range(i, min(i + 1000, stop)):
            pipe.xadd(stream, {"data": make_record(k, end, days, pool, in_order_of)})
        pipe.execute()
        i = min(i + 1000, stop)


def backends_cpu_s(admin, database: str) -> float | None:
    """CPU seconds of the server backends connected to ``database`` (not this one's),
    read from ``/proc/<pid>/stat``; None when none can be read there (a server on
    another machine). Other sessions' backends on the same database count too."""
    with admin.connect() as conn:
        pids = conn.execute(
            text(
                "SELECT pid FROM pg_stat_activity WHERE datname = :db AND pid <> pg_backend_pid()"
            ),
            {"db": database},
        ).scalars()
        total, seen = 0, False
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # a backend that ended meanwhile, or not on this machine
                continue
            total, seen = total + int(fields[11]) + int(fields[12]), True
    return total / os.sysconf("SC_CLK_TCK") if seen else None


class _CPU:
    """The writer's CPU (this process: the feeder is done before a window starts) and
    its database backends' over a window, in µs a row: unlike rows/s, what another
    machine's run can be held against (the two processes share this machine's cores)."""

    def __init__(self, pg_url: str):
        self.admin, self.database = create_engine(pg_url), make_url(pg_url).database

    def start(self) -> None:
        self.began = time.process_time(), backends_cpu_s(self.admin, self.database)

    def per_row(self, rows: int) -> dict:
        cpu, server = time.process_time(), backends_cpu_s(self.admin, self.database)
        out = {"writer_cpu_us": round(1e6 * (cpu - self.began[0]) / rows)}
        if server is not None and self.began[1] is not None:
            out["server_cpu_us"] = round(1e6 * (server - self.began[1]) / rows)
        return out


def _drain(writer: AuditWriter, until_rows: int, total: int, start: float) -> float:
    """Let the writer store rows until it has ``until_rows``; returns the seconds."""
    began, last_report = time.perf_counter(), 0.0
    while writer.stats.rows_written < until_rows:
        writer.step(block=True)
        now = time.perf_counter()
        if now - last_report >= 10:
            rate = writer.stats.rows_written / (now - start)
            done = f"{writer.stats.rows_written:,}/{total:,} rows, {rate:,.0f} rows/s overall"
            print(f"  filled {done}, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
            last_report = now
    return time.perf_counter() - began


def fill(args, config: DatabaseConfig, keys: Keys, end: float) -> dict:
    """Fill the table through the writer. The first and the last WINDOW rows are put on
    the stream before the writer drains them, so those rates are the writer's alone
    (the feeder would take a core of this two-core machine); the rows between are fed
    while the writer drains."""
    conn = redis.Redis.from_url(args.redis_url)
    engine = create_audit_engine(config)
    writer = AuditWriter(
        conn, engine, WriterConfig(prefix=keys.prefix, consumer="bench", audit_key=KEY)
    )
    writer.ensure_group()
    window = min(WINDOW, args.rows // 2)
    feed_args = (args.redis_url, keys.audit, keys.prefix)
    own_the_collector()  # as `lorapool audit-writer` does; undone after the fill
    rates, cpu, start = {}, _CPU(args.pg_url), time.perf_counter()
    spans = [(0, window, "first"), (window, args.rows - window, None)]
    spans.append((args.rows - window, args.rows, "last"))
    for low, high, name in spans:
        ahead = AHEAD if name is None else high
        span = (low, high, end, args.days, ahead, args.in_order and args.rows)
        feeder = multiprocessing.Process(target=feed, args=(*feed_args, *span))
        feeder.start()
        if name is not None:
            feeder.join()  # every record of the window on the stream first
            cpu.start()
        took = _drain(writer, high, args.rows, start)
        feeder.join()
        if name is not None:
            rates[f"rows_per_s_{name}"] = round((high - low) / took)
            rates[f"cpu_{name}"] = cpu.per_row(high - low)
    total = time.perf_counter() - start
    gc.unfreeze()
    gc.set_threshold(*DEFAULT_GC)  # the queries after it run as in any process
    store.refresh_rollup(engine)  # what the writer does once idle
    with engine.begin() as conn:  # what autovacuum does; the test server runs without it,
        conn.execute(text("ANALYZE completions"))  # and unanalyzed partitions get seq scans
    engine.dispose()
    cpu.admin.dispose()
    overall = round(writer.stats.rows_written / total)
    return {
        "rows": writer.stats.rows_written,
        "s": total,
        **rates,
        "rows_per_s_with_feeder": overall,
    }


def _schema(pg_url: str, name: str, drop: bool = False) -> None:
    admin = create_engine(pg_url)
    with admin.begin() as conn:
        verb = f'DROP SCHEMA IF EXISTS "{name}" CASCADE' if drop else f'CREATE SCHEMA "{name}"'
        conn.execute(text(verb))
    admin.dispose()


def _newest_arrival(config: DatabaseConfig) -> float:
    """The end of a reused schema's arrivals: the windows end where its fill's did."""
    engine = create_audit_engine(config)
    with engine.connect() as conn:
        newest = conn.execute(text("SELECT max(arrival_time) FROM completions")).scalar()
    engine.dispose()
    return newest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--days", type=float, default=90.0)
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument(
        "--pg-url",
        default=os.environ.get(
            "LORAPOOL_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument(
        "--schema", help="reuse this schema (already filled) instead of filling one"
    )
    parser.add_argument("--keep", action="store_true", help="keep the schema and Redis keys")
    parser.add_argument(
        "--fill-only", action="store_true", help="fill and keep the schema (for --schema later)"
    )
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument(
        "--in-order",
        action="store_true",
        help="rows arrive in time order (default: scattered over --days)",
    )
    args = parser.parse_args()
    run = uuid.uuid4().hex[:8]
    schema = args.schema or f"lorapool_bench_scale_{run}"
    keys = Keys(f"bench-scale-{run}")
    config = DatabaseConfig(url=args.pg_url, schema=schema)
    end = time.time() if args.schema is None else _newest_arrival(config)
    results: dict = {"rows": args.rows, "load_start": os.getloadavg(), "cpus": os.cpu_count()}
    try:
        if args.schema is None:
            _schema(args.pg_url, schema)
            migrate(create_audit_engine(config))
            print(f"filling {schema} with {args.rows:,} rows through the writer", file=sys.stderr)
            results["write"] = fill(args, config, keys, end)
            print(f"write: {results['write']}", file=sys.stderr, flush=True)
        if args.fill_only:
            args.keep = True
            print(f"kept {schema}: measure it with --schema {schema}", file=sys.stderr)
            return _report(results, args)
        with tempfile.TemporaryDirectory() as tmp:
            context = {"config": config, "keys": keys, "args": args, "tmp": tmp, "end": end}
            results["queries"] = queries(context)
            results["verify_export"] = verify_and_export(context)
        results["bytes"] = bytes_per_row(args, config)
    finally:
        if not args.keep:
            if args.schema is None:
                _schema(args.pg_url, schema, drop=True)
            conn = redis.Redis.from_url(args.redis_url)
            for key in conn.scan_iter(match=keys.pattern):
                conn.delete(key)
    _report(results, args)


def _report(results: dict, args) -> None:
    results["load_end"] = os.getloadavg()
    print(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())
    if args.json:
        with open(args.json, "wb") as f:
            f.write(orjson.dumps(results, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
