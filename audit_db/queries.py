"""Compliance queries over the audit tables.

Rows come back as plain dicts: every ``completions`` column except the hash
bookkeeping, plus the adapter's identity as ``adapter_name``, ``adapter_id``,
``adapter_path``, ``adapter_sha256``, ``adapter_rank``, ``adapter_alpha``,
``adapter_target_modules`` and ``adapter_base_model`` (all None for a
base-model request). Time ranges apply to the request's ``arrival_time``
(epoch seconds): ``since <= arrival_time < until``. Searches come in arrival
order (ties in chain order, so a request's completions stay together):
:func:`iter_search` streams them from a server-side cursor (memory stays
bounded at any size), :func:`search_page` gives one page and the position of
the next (a keyset cursor: no page is counted from the start).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Select, and_, case, func, or_, select

from lorapool.audit_db import exact_text
from lorapool.audit_db.schema import adapters, completions, conflicts
from lorapool.audit_db.walk import STREAM_ROWS

BASE_MODEL_KEY = "(base model)"
NO_TENANT_KEY = "(no tenant)"
USAGE_GROUPS = ("adapter", "adapter_version", "tenant")

_ADAPTER_COLUMNS = [
    adapters.c.name.label("adapter_name"),
    adapters.c.adapter_id.label("adapter_id"),
    adapters.c.path.label("adapter_path"),
    adapters.c.sha256.label("adapter_sha256"),
    adapters.c.rank.label("adapter_rank"),
    adapters.c.alpha.label("adapter_alpha"),
    adapters.c.target_modules.label("adapter_target_modules"),
    adapters.c.base_model.label("adapter_base_model"),
]
_HIDDEN = ("adapter_pk", "prev_hash", "period", "prompt_tokens", "output_tokens", "chain_version")
_ROW_COLUMNS = [c for c in completions.c if c.name not in _HIDDEN] + [
    completions.c.prompt_tokens,
    completions.c.output_tokens,
]
_JOINED = completions.outerjoin(adapters, completions.c.adapter_pk == adapters.c.pk)


@dataclass(frozen=True)
class SearchFilter:
    """What :func:`search` looks for; every field left None matches anything.

    adapter_sha256 matches as a prefix; text is a case-sensitive substring of
    the output text (any code point, NUL included); base_model_only selects
    requests run without an adapter; pool is the Redis prefix.
    """

    pool: str | None = None
    adapter_name: str | None = None
    adapter_id: int | None = None
    adapter_sha256: str | None = None
    base_model_only: bool = False
    since: float | None = None
    until: float | None = None
    finish_reason: str | None = None
    tenant: str | None = None
    text: str | None = None
    limit: int | None = 100


@dataclass(frozen=True)
class UsageRow:
    """Usage of one adapter (or tenant) over a period.

    requests: distinct request ids; prompt_tokens counted once per request;
    completion_tokens summed over completions; errors: requests with an error
    text or an "error" finish reason; latency: finished_time - arrival_time per
    request, p50/p95 by linear interpolation (None when no request finished).
    """

    key: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    errors: int
    latency_p50: float | None
    latency_p95: float | None


def _select() -> Select:
    return select(*_ROW_COLUMNS, *_ADAPTER_COLUMNS).select_from(_JOINED)


def plain_row(row) -> dict[str, Any]:
    """A result row as the queries return it: token ids as lists whatever the row's
    chain version, the compact columns folded in."""
    out = {str(k): v for k, v in row.items()}
    if "prompt_tokens" in out:
        prompt, output = out.pop("prompt_tokens"), out.pop("output_tokens")
        if out["prompt_token_ids"] is None:
            out["prompt_token_ids"], out["token_ids"] = prompt, output
    return out


def _rows(engine: Engine, query: Select) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [plain_row(row) for row in conn.execute(query).mappings()]


def get_request(engine: Engine, request_id: str, pool: str | None = None) -> list[dict[str, Any]]:
    """All audit rows of one request (one per completion; of every pool unless ``pool``)."""
    query = (
        _select()
        .where(completions.c.request_id == request_id)
        .order_by(  # rows from before pools were recorded (NULL) first, on both dialects
            completions.c.pool.is_not(None), completions.c.pool, completions.c.completion_index
        )
    )
    if pool is not None:
        query = query.where(completions.c.pool == pool)
    return _rows(engine, query)


def _time_filters(since: float | None, until: float | None) -> list:
    filters = []
    if since is not None:
        filters.append(completions.c.arrival_time >= since)
    if until is not None:
        filters.append(completions.c.arrival_time < until)
    return filters


def _contains(conn: Connection, needle: str):
    """Case-sensitive substring test on the stored (escaped) text, both dialects.

    Exact unless ``exact_text.needs_recheck(needle)``; then a superset, which
    :func:`search` narrows down.
    """
    fn = func.strpos if conn.dialect.name == "postgresql" else func.instr
    return fn(completions.c.text, exact_text.encode(needle)) > 0


def _adapter_pks(conn: Connection, f: SearchFilter) -> list[int] | None:
    """The adapters the filter names (None: it names none), looked up first so that
    the rows are found through the ``(adapter_pk, arrival_time)`` index."""
    wanted = []
    if f.adapter_name is not None:
        wanted.append(adapters.c.name == f.adapter_name)
    if f.adapter_id is not None:
        wanted.append(adapters.c.adapter_id == f.adapter_id)
    if f.adapter_sha256 is not None:
        wanted.append(adapters.c.sha256.startswith(f.adapter_sha256.lower(), autoescape=True))
    if not wanted:
        return None
    return list(conn.execute(select(adapters.c.pk).where(*wanted)).scalars())


def _filters(conn: Connection, f: SearchFilter) -> list:
    filters = _time_filters(f.since, f.until)
    if f.pool is not None:
        filters.append(completions.c.pool == f.pool)
    pks = _adapter_pks(conn, f)
    if pks is not None:
        filters.append(completions.c.adapter_pk.in_(pks))
    if f.base_model_only:
        filters.append(completions.c.adapter_pk.is_(None))
    if f.finish_reason is not None:
        filters.append(completions.c.finish_reason == f.finish_reason)
    if f.tenant is not None:
        filters.append(completions.c.tenant == f.tenant)
    if f.text is not None:
        filters.append(_contains(conn, f.text))
    return filters


Position = tuple[float, int]  # (arrival_time, seq) of a row: where a page ends


def position(row: dict[str, Any]) -> Position:
    return (row["arrival_time"], row["seq"])


def _after(after: Position | None) -> list:
    if after is None:
        return []
    arrival, seq = after
    return [
        completions.c.arrival_time >= arrival,
        or_(
            completions.c.arrival_time > arrival,
            and_(completions.c.arrival_time == arrival, completions.c.seq > seq),
        ),
    ]


def _stream(conn: Connection, f: SearchFilter, after: Position | None, limit: int | None):
    query = (
        _select()
        .where(*_filters(conn, f), *_after(after))
        .order_by(completions.c.arrival_time, completions.c.seq)
    )
    recheck = f.text is not None and exact_text.needs_recheck(f.text)
    if limit is not None and not recheck:
        query = query.limit(limit)
    options = {"stream_results": True, "yield_per": STREAM_ROWS}
    found = 0
    for row in conn.execute(query, execution_options=options).mappings():
        row = plain_row(row)
        if recheck and f.text not in row["text"]:
            continue
        yield row
        found += 1
        if limit is not None and found >= limit:
            return


def iter_search(
    engine: Engine, f: SearchFilter, after: Position | None = None
) -> Iterator[dict[str, Any]]:
    """Rows matching every filter (up to ``f.limit``; None: all), in arrival order,
    after ``after``, streamed from a server-side cursor: one connection is held until
    the iterator is exhausted or closed."""
    with engine.connect() as conn:
        yield from _stream(conn, f, after, f.limit)


def search(engine: Engine, f: SearchFilter) -> list[dict[str, Any]]:
    """Audit rows matching every given filter, in arrival order (see :func:`iter_search`)."""
    return list(iter_search(engine, f))


def search_page(
    engine: Engine, f: SearchFilter, limit: int, after: Position | None = None
) -> tuple[list[dict[str, Any]], Position | None]:
    """One page of at most ``limit`` rows after ``after``, and the position the next
    page starts after (None: this was the last)."""
    with engine.connect() as conn:
        rows = list(_stream(conn, f, after, limit + 1))
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, position(rows[-1]) if more else None


def list_conflicts(engine: Engine, pool: str | None = None) -> list[dict[str, Any]]:
    """Every recorded conflict (oldest first): the key, both digests, the refused row."""
    query = select(conflicts).order_by(conflicts.c.pk)
    if pool is not None:
        query = query.where(conflicts.c.pool == pool)
    return _rows(engine, query)


def _group_column(by: str):
    if by == "adapter":
        return func.coalesce(adapters.c.name, BASE_MODEL_KEY)
    if by == "adapter_version":
        version = adapters.c.name + "@" + func.substr(adapters.c.sha256, 1, 12)
        return func.coalesce(version, BASE_MODEL_KEY)
    if by == "tenant":
        return func.coalesce(completions.c.tenant, NO_TENANT_KEY)
    raise ValueError(f"usage groups by one of {USAGE_GROUPS}, not {by!r}")


def _per_request(by: str, since: float | None, until: float | None) -> Select:
    failed = or_(completions.c.error.is_not(None), completions.c.finish_reason == "error")
    key = _group_column(by).label("group_key")
    return (
        select(
            key,
            completions.c.request_id,
            func.max(completions.c.num_prompt_tokens),
            func.sum(completions.c.num_output_tokens),
            func.max(case((failed, 1), else_=0)),
            func.max(completions.c.finished_time - completions.c.arrival_time),
        )
        .select_from(_JOINED)
        .where(*_time_filters(since, until))
        .group_by(key, completions.c.request_id)
    )


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between sorted values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _summarize(key: str, requests: Iterable[tuple]) -> UsageRow:
    requests = list(requests)
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


def usage(
    engine: Engine, by: str = "adapter", since: float | None = None, until: float | None = None
) -> list[UsageRow]:
    """Usage per adapter name, adapter version ("name@sha256[:12]") or tenant, by key."""
    groups: dict[str, list[tuple]] = defaultdict(list)
    with engine.connect() as conn:
        for key, _rid, prompt, output, failed, latency in conn.execute(
            _per_request(by, since, until)
        ):
            groups[key].append((prompt, output, failed, latency))
    return [_summarize(key, groups[key]) for key in sorted(groups)]
