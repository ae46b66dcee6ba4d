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

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Select, and_, or_, select

from lorapool.audit_db import exact_text, text_search
from lorapool.audit_db.schema import adapters, completions, conflicts
from lorapool.audit_db.text_search import TextSearchRefused
from lorapool.audit_db.usage import (
    BASE_MODEL_KEY,
    NO_TENANT_KEY,
    USAGE_GROUPS,
    UsageRow,
    percentile,
    time_filters,
    usage,
)
from lorapool.audit_db.walk import STREAM_ROWS

__all__ = [
    "BASE_MODEL_KEY",
    "NO_TENANT_KEY",
    "USAGE_GROUPS",
    "SearchFilter",
    "TextSearchRefused",
    "check_filter",
    "UsageRow",
    "get_request",
    "iter_search",
    "list_conflicts",
    "percentile",
    "search",
    "search_page",
    "usage",
]


_ADAPTER_COLUMNS = [
    adapters.c.name.label("adapter_name"),
    adapters.c.adapter_id.label("adapter_id"),
    adapters.c.path.label("adapter_path"),
    adapters.c.sha256.label("adapter_sha256"),
    adapters.c.rank.label("adapter_rank"),
    adapters.c.alpha.label("adapter_alpha"),
    adapters.c.target_modules.label("adapter_target_modules"),
    adapters.c.base_model.label("adapter_base_model"),
    adapters.c.config_sha256.label("adapter_config_sha256"),
    adapters.c.digest.label("adapter_digest"),
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
    the output text (any code point, NUL included; see text_search.py for when it
    needs a time window); base_model_only selects
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
    filters = time_filters(f.since, f.until)
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
    if f.text is not None:  # through the text index, or within a small time window
        filters.append(text_search.condition(conn, f.text, f.since, f.until))
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


def check_filter(engine: Engine, f: SearchFilter) -> None:
    """Raise :class:`TextSearchRefused` now if the search would be refused (a
    streamed export checks before its first byte goes out)."""
    if f.text is not None:
        with engine.connect() as conn:
            text_search.condition(conn, f.text, f.since, f.until)


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
