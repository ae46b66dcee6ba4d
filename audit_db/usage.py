"""Usage per adapter, adapter version or tenant over a period: requests, tokens,
errors, latency percentiles; computed in SQL.

Over few requests (at most :data:`EXACT_MAX_REQUESTS`, or when asked) the answer
is exact: one SQL query groups the rows by request and then by group, with
``percentile_cont`` for the percentiles on PostgreSQL (SQLite has no ordered-set
aggregates: its per-request latencies are ranked in Python). Over more, whole days
come from the writer's rollup (rollup.py), and from the rows only the partial days
at the ends of the period and the rows the rollup does not cover yet: counts stay
exact, percentiles come from the rollup's latency histogram (within about 0.5%;
``latency_exact`` says which).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, Select, case, func, or_, select

from lorapool.audit_db import rollup
from lorapool.audit_db.schema import adapters, completions, usage_daily

BASE_MODEL_KEY = "(base model)"
NO_TENANT_KEY = "(no tenant)"
USAGE_GROUPS = ("adapter", "adapter_version", "tenant")
EXACT_MAX_REQUESTS = 10_000  # up to here the rows themselves are read (measured: RESULTS.md)
_JOINED = completions.outerjoin(adapters, completions.c.adapter_pk == adapters.c.pk)


@dataclass(frozen=True)
class UsageRow:
    """Usage of one adapter (or tenant) over a period.

    requests: distinct requests; prompt_tokens counted once per request;
    completion_tokens summed over completions; errors: requests with an error
    text or an "error" finish reason; latency: finished_time - arrival_time per
    request, p50/p95 by linear interpolation (None when no request finished);
    latency_exact: False when they come from the rollup's histogram.
    """

    key: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    errors: int
    latency_p50: float | None
    latency_p95: float | None
    latency_exact: bool = True


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between sorted values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def time_filters(since: float | None, until: float | None) -> list:
    """Where clauses of rows that arrived in [since, until) (None: no bound)."""
    filters = []
    if since is not None:
        filters.append(completions.c.arrival_time >= since)
    if until is not None:
        filters.append(completions.c.arrival_time < until)
    return filters


def _group_column(by: str):
    if by == "adapter":
        return func.coalesce(adapters.c.name, BASE_MODEL_KEY)
    if by == "adapter_version":
        version = adapters.c.name + "@" + func.substr(adapters.c.sha256, 1, 12)
        return func.coalesce(version, BASE_MODEL_KEY)
    return func.coalesce(completions.c.tenant, NO_TENANT_KEY)


def _per_request(by: str, since: float | None, until: float | None) -> Select:
    failed = or_(completions.c.error.is_not(None), completions.c.finish_reason == "error")
    key = _group_column(by).label("group_key")
    latency = func.max(completions.c.finished_time - completions.c.arrival_time)
    return (
        select(
            key,
            func.max(completions.c.num_prompt_tokens).label("prompt"),
            func.sum(completions.c.num_output_tokens).label("output"),
            func.max(case((failed, 1), else_=0)).label("failed"),
            latency.label("latency"),
        )
        .select_from(_JOINED)
        .where(*time_filters(since, until))
        .group_by(key, completions.c.pool, completions.c.request_id)
    )


def _exact_sql(conn: Connection, by: str, since, until) -> list[UsageRow]:
    """PostgreSQL: everything in one query, percentiles by ``percentile_cont``."""
    per = _per_request(by, since, until).subquery()
    query = (
        select(
            per.c.group_key,
            func.count(),
            func.sum(per.c.prompt),
            func.sum(per.c.output),
            func.sum(per.c.failed),
            func.percentile_cont(0.5).within_group(per.c.latency),
            func.percentile_cont(0.95).within_group(per.c.latency),
        )
        .group_by(per.c.group_key)
        .order_by(per.c.group_key)
    )
    rows = conn.execute(query)  # sum() over bigint is numeric (a Decimal): back to int
    return [
        UsageRow(k, n, int(p or 0), int(o or 0), int(e), p50, p95)
        for k, n, p, o, e, p50, p95 in rows
    ]


def _summarize(key: str, requests: list[tuple]) -> UsageRow:
    latencies = [r[3] for r in requests if r[3] is not None]
    return UsageRow(
        key=key,
        requests=len(requests),
        prompt_tokens=sum(r[0] or 0 for r in requests),
        completion_tokens=sum(r[1] or 0 for r in requests),
        errors=sum(r[2] for r in requests),
        latency_p50=percentile(latencies, 50),
        latency_p95=percentile(latencies, 95),
    )


def _exact(conn: Connection, by: str, since, until) -> list[UsageRow]:
    if conn.dialect.name == "postgresql":
        return _exact_sql(conn, by, since, until)
    groups: dict[str, list[tuple]] = defaultdict(list)
    for key, prompt, output, failed, latency in conn.execute(_per_request(by, since, until)):
        groups[key].append((prompt, output, failed, latency))
    return [_summarize(key, groups[key]) for key in sorted(groups)]


def _requests_at_most(conn: Connection, since, until, rolled: int) -> int:
    """The rollup's request count over the days the period touches, plus the rows it
    does not cover yet (an upper bound)."""
    query = select(func.coalesce(func.sum(usage_daily.c.requests), 0)).where(
        usage_daily.c.dimension == rollup.TENANT
    )
    if since is not None:
        query = query.where(usage_daily.c.day >= rollup.day_of(since))
    if until is not None:
        query = query.where(usage_daily.c.day <= rollup.day_of(until))
    head = conn.execute(select(func.max(completions.c.seq))).scalar() or 0
    return conn.execute(query).scalar() + max(head - rolled, 0)


def _spans(since, until, first_day, end_day) -> list[tuple]:
    """The parts of the period the rollup's whole days leave out."""
    if first_day is not None and end_day is not None and first_day > end_day:
        return [(since, until)]  # within one day
    spans = []
    if since is not None and since < first_day * rollup.DAY_S:
        spans.append((since, first_day * rollup.DAY_S))
    if until is not None and end_day * rollup.DAY_S < until:
        spans.append((end_day * rollup.DAY_S, until))
    return spans


def _edges(conn: Connection, spans: list[tuple], since, until, rolled: int) -> Iterable[tuple]:
    """The rows the rollup leaves out (tuples of ``rollup.ROW_COLUMNS``): of the partial
    days at the ends of the period (up to the rollup's position), and any of the period
    after that position."""
    covered = completions.c.seq <= rolled
    for low, high in spans:
        query = select(*rollup.ROW_SELECT).where(*time_filters(low, high), covered)
        yield from conn.execute(query).all()  # at most a day's rows at each end
    after = completions.c.seq > rolled
    query = select(*rollup.ROW_SELECT).where(*time_filters(since, until), after)
    yield from conn.execute(query).all()


def _group_names(conn: Connection, by: str) -> dict[str, str]:
    """rollup group_key -> the usage key it belongs to."""
    if by == "tenant":
        return {}
    names = {"": BASE_MODEL_KEY}
    for pk, name, sha256 in conn.execute(select(adapters.c.pk, adapters.c.name, adapters.c.sha256)):
        names[str(pk)] = name if by == "adapter" else f"{name}@{sha256[:12]}"
    return names


def _name(group_key: str, names: dict[str, str]) -> str:
    if names:
        return names.get(group_key, group_key)
    return group_key[2:] if group_key.startswith("t:") else NO_TENANT_KEY


def _rolled(conn: Connection, by: str, since, until, rolled: int) -> list[UsageRow]:
    dimension = rollup.TENANT if by == "tenant" else rollup.ADAPTER
    first_day = None if since is None else math.ceil(since / rollup.DAY_S)
    end_day = None if until is None else math.floor(until / rollup.DAY_S)
    spans = _spans(since, until, first_day, end_day)
    whole_days = not (spans and spans[0] == (since, until))
    cells = rollup.read(conn, dimension, first_day, end_day) if whole_days else {}
    edge_rows = _edges(conn, spans, since, until, rolled)
    edge = rollup.cells_of(rollup.requests_of(edge_rows), (dimension,))
    for (_day, _dim, key), cell in edge.items():
        cells.setdefault(key, rollup.Cell()).merge(cell)
    names = _group_names(conn, by)
    merged: dict[str, rollup.Cell] = defaultdict(rollup.Cell)
    for key, cell in cells.items():
        merged[_name(key, names)].merge(cell)
    return [_from_cell(key, merged[key]) for key in sorted(merged) if merged[key].requests]


def _from_cell(key: str, cell: rollup.Cell) -> UsageRow:
    p50, p95 = (rollup.percentile(cell.latency_hist, q) for q in (50, 95))
    counts = (cell.requests, cell.prompt_tokens, cell.completion_tokens, cell.errors)
    return UsageRow(key, *counts, p50, p95, latency_exact=False)


def usage(
    engine: Engine,
    by: str = "adapter",
    since: float | None = None,
    until: float | None = None,
    exact: bool | None = None,
) -> list[UsageRow]:
    """Usage per adapter name, adapter version ("name@sha256[:12]") or tenant, by key.

    ``exact``: True reads every row of the period; False reads the rollup (whole days)
    and the rows of the partial days; None (default) the first for up to
    :data:`EXACT_MAX_REQUESTS` requests, else the second.
    """
    if by not in USAGE_GROUPS:
        raise ValueError(f"usage groups by one of {USAGE_GROUPS}, not {by!r}")
    with engine.connect() as conn:
        rolled = rollup.rolled_seq(conn)
        if exact is None:
            exact = _requests_at_most(conn, since, until, rolled) <= EXACT_MAX_REQUESTS
        if exact:
            return _exact(conn, by, since, until)
        return _rolled(conn, by, since, until, rolled)
