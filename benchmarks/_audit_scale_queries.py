"""What benchmarks/audit_scale.py measures once the table is full: the interactive
queries three ways, verify, exports, bytes per row."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from unittest import mock

import httpx
from _audit_scale_measure import PeakRSS, SQLTimer, cli, http, in_process, stream_http
from sqlalchemy import create_engine, text

from lorapool.audit_db import DatabaseConfig, checkpoints, create_audit_engine, migrate
from lorapool.audit_db.queries import SearchFilter, get_request, search_page
from lorapool.audit_db.usage import usage
from lorapool.audit_db.verify import verify_chain

DAY = 86_400.0


@contextmanager
def gateway(context):
    """``lorapool serve`` on the benchmark's database (no keys), its URL and pid."""
    args, config = context["args"], context["config"]
    port = 20000 + os.getpid() % 20000
    cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", "serve",
           "--port", str(port), "--prefix", context["keys"].prefix, "--redis-url", args.redis_url,
           "--no-auth", "--log-level", "warning", "--audit-db-url", config.url,
           "--audit-db-schema", config.schema]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=context["tmp"])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _env(context) -> dict:
    config = context["config"]
    db = {"LORAPOOL_DB_URL": config.url, "LORAPOOL_DB_SCHEMA": config.schema}
    env = {**os.environ, **db, "LORAPOOL_AUDIT_KEY": _key().decode()}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an install has its bytecode compiled
    return env


def _cli_median(args: list[str], env: dict, repeat: int = 3) -> dict:
    """The CLI's median wall time of ``repeat`` runs (a loaded box swings a single one),
    each run's time, and the highest peak RSS."""
    runs = [cli(args, env) for _ in range(repeat)]
    walls = sorted(r["s"] for r in runs)
    peak = max(r["peak_mib"] for r in runs)
    return {"s": walls[len(walls) // 2], "runs_s": [round(w, 3) for w in walls], "peak_mib": peak}


def _the_four(context) -> dict:
    """The interactive queries: (in-process function, CLI args, HTTP path and params)."""
    end, rid = context["end"], f"r-{context['args'].rows // 3}"
    week, month = {"since": end - 7 * DAY, "until": end}, {"since": end - 30 * DAY, "until": end}
    by_adapter = SearchFilter(adapter_name="lora-17", limit=None, **week)
    text_search = SearchFilter(text="zebracorn", limit=None, **week)
    no_match = SearchFilter(text="no such phrase anywhere", limit=None, **week)

    first_page = ["--limit", "100", "--format", "json"]

    def span(period):
        return ["--since", str(period["since"]), "--until", str(period["until"])]

    return {
        "request by id": (
            lambda e: get_request(e, rid),
            ["audit", "request", rid, "--format", "json"],
            (f"/v1/audit/completions/{rid}", {}),
        ),
        "adapter over 7 days, first page": (
            lambda e: search_page(e, by_adapter, 100),
            ["audit", "search", "--adapter", "lora-17", *span(week), *first_page],
            ("/v1/audit/completions", {"adapter": "lora-17", **week, "limit": 100}),
        ),
        "usage over 30 days by adapter": (
            lambda e: usage(e, "adapter", **month),
            ["audit", "usage", "--by", "adapter", *span(month), "--format", "json"],
            ("/v1/audit/usage", {"group_by": "adapter", **month}),
        ),
        "usage over 30 days by tenant": (
            lambda e: usage(e, "tenant", **month),
            ["audit", "usage", "--by", "tenant", *span(month), "--format", "json"],
            ("/v1/audit/usage", {"group_by": "tenant", **month}),
        ),
        "text search in a 7-day window": (
            lambda e: search_page(e, text_search, 100),
            ["audit", "search", "--text", "zebracorn", *span(week), *first_page],
            ("/v1/audit/completions", {"q": "zebracorn", **week, "limit": 100}),
        ),
        "text search, no match, 7 days": (
            lambda e: search_page(e, no_match, 100),
            ["audit", "search", "--text", "no such phrase anywhere", *span(week), *first_page],
            ("/v1/audit/completions", {"q": "no such phrase anywhere", **week, "limit": 100}),
        ),
        "usage over 30 days, exact (percentile_cont)": (
            lambda e: usage(e, "adapter", exact=True, **month),
            ["audit", "usage", "--by", "adapter", *span(month), "--exact", "--format", "json"],
            ("/v1/audit/usage", {"group_by": "adapter", **month, "exact": "true"}),
        ),
    }  # fmt: skip


def queries(context) -> dict:
    engine = create_audit_engine(context["config"])
    timer = SQLTimer(engine)
    found = {}
    with gateway(context) as (url, pid), httpx.Client(base_url=url, timeout=120) as client:
        for name, (fn, args, (path, params)) in _the_four(context).items():
            result = {"in_process": in_process(timer, lambda fn=fn: fn(engine))}
            result["cli"] = _cli_median(args, _env(context))
            result["http"] = http(client, path, params, pid)
            print(f"  {name}: {result}", file=sys.stderr, flush=True)
            found[name] = result
    found["plans"] = _plans(engine, context["end"])
    engine.dispose()
    return found


def _plans(engine, end: float) -> dict:
    week = f"arrival_time >= {end - 7 * DAY} AND arrival_time < {end}"
    pk = "(SELECT pk FROM adapters WHERE name = 'lora-17')"
    sqls = {
        "adapter over 7 days": f"SELECT seq FROM completions WHERE adapter_pk IN {pk} AND {week} "
        "ORDER BY arrival_time, seq LIMIT 101",
        "text in 7 days": f"SELECT seq FROM completions WHERE text LIKE '%zebracorn%' AND {week} "
        "ORDER BY arrival_time, seq LIMIT 101",
        "request by id": "SELECT seq FROM completions WHERE request_id = 'r-1234'",
    }
    plans = {}
    with engine.connect() as conn:
        for name, sql in sqls.items():
            lines = [r[0] for r in conn.execute(text(f"EXPLAIN (ANALYZE, COSTS OFF) {sql}"))]
            plans[name] = lines
    return plans


def _since_a_day_ago(engine, rows: int, days: float) -> checkpoints.Checkpoint:
    """The checkpoint a day's rows (rows / days) before the head."""
    with engine.connect() as conn:
        points = checkpoints.every(conn)
    head = points[-1].seq if points else rows
    target = head - rows / days
    return min(points, key=lambda p: abs(p.seq - target))


def verify_and_export(context) -> dict:
    args, tmp = context["args"], context["tmp"]
    engine = create_audit_engine(context["config"])
    found = {}
    with PeakRSS() as memory:
        start = time.perf_counter()
        report = verify_chain(engine, key=_key())
        full = time.perf_counter() - start
    assert report.ok, report.describe_failure()
    found["full verify"] = {"s": full, "rows": report.num_rows, "peak_mib": round(memory.mib, 1)}
    point = _since_a_day_ago(engine, args.rows, args.days)
    start = time.perf_counter()
    report = verify_chain(engine, key=_key(), since=point.id)
    found["incremental verify"] = {"s": time.perf_counter() - start, "rows": report.num_rows}
    cli_args = ["audit", "verify", "--from-checkpoint", str(point.id), "--state", f"{tmp}/state"]
    found["incremental verify"]["cli"] = cli(cli_args, _env(context))
    print(f"  verify: {found}", file=sys.stderr, flush=True)
    end = context["end"]
    for name, since in (
        ("export 100k rows", end - args.days * DAY * 100_000 / args.rows),
        ("export every row", None),
    ):
        span = [] if since is None else ["--since", str(since)]
        out = f"{tmp}/export.csv"
        result = cli(["audit", "export", "--format", "csv", *span, "-o", out], _env(context))
        with open(out, "rb") as f:
            result["rows"] = sum(1 for _ in f) - 1  # (a text with a newline would count twice)
        result["bytes"] = os.path.getsize(out)
        os.remove(out)
        found[name] = {"cli": result}
        print(f"  {name}: {result}", file=sys.stderr, flush=True)
    with gateway(context) as (url, pid), httpx.Client(base_url=url, timeout=600) as client:
        since = end - args.days * DAY * 100_000 / args.rows
        found["export 100k rows"]["http"] = stream_http(
            client, "/v1/audit/export", {"format": "csv", "since": since}, pid
        )
    engine.dispose()
    return found


def _key() -> bytes:
    from audit_scale import KEY

    return KEY


def _table_bytes(engine) -> tuple[int, int]:
    with engine.connect() as conn:
        size = conn.execute(
            text("SELECT coalesce(sum(pg_total_relation_size(i.inhrelid)), 0) FROM pg_inherits i "
                 "WHERE i.inhparent = 'completions'::regclass")
        ).scalar()  # fmt: skip
        rows = conn.execute(text("SELECT count(*) FROM completions")).scalar()
    return int(size), rows  # sum() of bigints is a numeric


def bytes_per_row(args, config: DatabaseConfig, sample: int = 20_000) -> dict:
    """The full table's bytes per row, and a sample written as compact (version 2) and
    as JSON-token (version 1) rows, side by side."""
    from audit_scale import KEY, make_record

    from lorapool.audit_db.guard import ChainGuard
    from lorapool.audit_db.rows import prepare
    from lorapool.audit_db.store import append
    from lorapool.records.audit import parse_record

    size, rows = _table_bytes(create_audit_engine(config))
    found = {"table": {"bytes": size, "rows": rows, "bytes_per_row": round(size / max(rows, 1))}}
    for version in (2, 1):
        schema = f"lorapool_bench_bytes_{uuid.uuid4().hex[:8]}"
        admin = create_engine(args.pg_url)
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        try:
            engine = create_audit_engine(DatabaseConfig(url=args.pg_url, schema=schema))
            migrate(engine)
            compact = mock.patch("lorapool.audit_db.tokens.packed_or_none", return_value=None)
            guard = ChainGuard(KEY)  # one for the sample, as a writer keeps one: a fresh
            with compact if version == 1 else _nothing():  # one re-verifies every batch
                for start in range(0, sample, 500):
                    made = [
                        make_record(i, time.time(), args.days, "p")
                        for i in range(start, start + 500)
                    ]
                    records = [parse_record(m, key=KEY, pool="p") for m in made]
                    rows = [r for record in records for r in prepare(record, "p")]
                    append(engine, rows, KEY, guard)
            size, rows = _table_bytes(engine)
            found[f"sample v{version}"] = {"bytes_per_row": round(size / rows), "rows": rows}
            engine.dispose()
        finally:
            with admin.begin() as conn:
                conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            admin.dispose()
    print(f"  bytes: {found}", file=sys.stderr, flush=True)
    return found


@contextmanager
def _nothing():
    yield
