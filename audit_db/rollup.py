"""Usage per day, kept by the writer: ``usage_daily``, one row per (day, dimension,
group) with requests, prompt and completion tokens, errors and a latency histogram.

The writer refreshes it every few thousand rows and when idle (:func:`refresh`:
the rows after ``usage_progress.rolled`` aggregated in one go, a few hundred cells
for thousands of rows), so it costs the write path a few microseconds a row;
``usage`` reads whole days from it and adds the rows it does not cover yet
(usage.py). Days are UTC days of the request's
``arrival_time``. The dimension is ``adapter`` (``group_key`` is the adapter's pk,
``""`` for the base model) or ``tenant`` (``"t:"`` + the tenant, ``""`` for none).
A request counts once (on its rows of one record), its prompt tokens once, its
completion tokens over every completion; it is an error when it has an error text
or a completion finished with ``error``; its latency is ``finished_time -
arrival_time``.

The latency histogram maps bucket ``b`` to a count of requests whose latency ``l``
has ``floor(log(l) / log(1.01)) == b``: a percentile read from it lies within
about 0.5% of the exact one. The rollup survives ``audit archive`` (usage of
archived months stays answerable); :func:`rebuild` recomputes it from the rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from sqlalchemy import (
    Connection,
    String,
    delete,
    func,
    select,
    text,
    tuple_,
    type_coerce,
)
from sqlalchemy.dialects import postgresql, sqlite

from lorapool.audit_db import exact_text
from lorapool.audit_db.schema import completions, usage_daily, usage_progress

if TYPE_CHECKING:
    from lorapool.audit_db.chaining import Known

DAY_S = 86_400
BASE = 1.01
MIN_LATENCY = 1e-6  # a latency at or below this is counted in the bucket of this
ADAPTER, TENANT = "adapter", "tenant"


def bucket(latency: float) -> int:
    return math.floor(math.log(max(latency, MIN_LATENCY)) / math.log(BASE))


def bucket_value(b: int) -> float:
    """The latency a bucket stands for: the geometric middle of its bounds."""
    return BASE ** (b + 0.5)


def day_of(timestamp: float) -> int:
    return math.floor(timestamp / DAY_S)


def adapter_key(pk: int | None) -> str:
    return "" if pk is None else str(pk)


def tenant_key(tenant: str | None) -> str:
    return "" if tenant is None else "t:" + tenant


@dataclass
class Cell:
    """One (day, dimension, group)'s usage."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    latency_hist: dict[int, int] = field(default_factory=dict)

    def add_request(self, prompt: int, completion: int, failed: bool, latency: float | None):
        self.requests += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.errors += int(failed)
        if latency is not None:
            b = bucket(latency)
            self.latency_hist[b] = self.latency_hist.get(b, 0) + 1

    def merge(self, other: Cell) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.errors += other.errors
        for b, n in other.latency_hist.items():
            self.latency_hist[b] = self.latency_hist.get(b, 0) + n


Key = tuple[int, str, str]  # (day, dimension, group_key)


@dataclass
class Request:
    """One request's usage, from its rows."""

    day: int
    adapter_pk: int | None
    tenant: str | None
    prompt: int
    completion: int = 0
    failed: bool = False
    latency: float | None = None


ROW_COLUMNS = ("pool", "request_id", "completion_index", "adapter_pk", "tenant",
               "num_prompt_tokens", "num_output_tokens", "error", "finish_reason",
               "arrival_time", "finished_time")  # fmt: skip


# what requests_of reads; a request's pool and id only tell requests apart, and their
# stored (escaped, exact_text.py) forms do that as well: not decoded, ~1 µs a row each
ROW_SELECT = [
    type_coerce(completions.c[c], String) if c in ("pool", "request_id") else completions.c[c]
    for c in ROW_COLUMNS
]


def requests_of(rows: Iterable[Sequence[Any]]) -> list[Request]:
    """The requests of chained rows, each a tuple of :data:`ROW_COLUMNS` in that order
    (tuples, not mappings: a usage query reads ~11,000 of them, the writer 10,000 a
    refresh)."""
    found: dict[tuple, Request] = {}
    for pool, request_id, _, pk, tenant, prompt, output, error, reason, arrival, end in rows:
        request = found.get((pool, request_id))
        if request is None:
            latency = None if end is None else end - arrival
            request = Request(day_of(arrival), pk, tenant, prompt, latency=latency)
            found[(pool, request_id)] = request
        request.completion += output
        request.failed |= error is not None or reason == "error"
    return list(found.values())


def cells_of(
    requests: Iterable[Request], dimensions: tuple[str, ...] = (ADAPTER, TENANT)
) -> dict[Key, Cell]:
    """The requests' cells in ``dimensions`` (usage asks for the one it groups by)."""
    adapter, tenant = ADAPTER in dimensions, TENANT in dimensions
    cells: dict[Key, Cell] = {}
    for r in requests:
        keys = []
        if adapter:
            keys.append((r.day, ADAPTER, adapter_key(r.adapter_pk)))
        if tenant:
            keys.append((r.day, TENANT, tenant_key(r.tenant)))
        for key in keys:
            cell = cells.get(key)
            if cell is None:
                cell = cells[key] = Cell()
            cell.add_request(r.prompt, r.completion, r.failed, r.latency)
    return cells


def _cell(row: Mapping[str, Any]) -> Cell:
    hist = {int(b): n for b, n in (row["latency_hist"] or {}).items()}
    counts = (row["requests"], row["prompt_tokens"], row["completion_tokens"], row["errors"])
    return Cell(*counts, hist)


def _stored(conn: Connection, keys: list[Key]) -> dict[Key, Cell]:
    """SQLite: the stored cells of ``keys`` (an IN list, 500 keys a statement: SQLite's
    bound variables); PostgreSQL adds to them in the upsert instead."""
    found: dict[Key, Cell] = {}
    columns = tuple_(usage_daily.c.day, usage_daily.c.dimension, usage_daily.c.group_key)
    for start in range(0, len(keys), 500):
        query = select(usage_daily).where(columns.in_(keys[start : start + 500]))
        for row in conn.execute(query).mappings():
            found[(row["day"], row["dimension"], row["group_key"])] = _cell(row)
    return found


def _row(key: Key, cell: Cell) -> dict[str, Any]:
    return {
        "day": key[0],
        "dimension": key[1],
        "group_key": key[2],
        "requests": cell.requests,
        "prompt_tokens": cell.prompt_tokens,
        "completion_tokens": cell.completion_tokens,
        "errors": cell.errors,
        "latency_hist": {str(b): n for b, n in sorted(cell.latency_hist.items())},
    }


def add(conn: Connection, rows: Iterable[Mapping[str, Any]]) -> None:
    """Add the usage of rows not counted yet (under the chain lock: no other writer
    changes the rollup meanwhile)."""
    add_cells(conn, cells_of(requests_of(rows)))


def add_cells(conn: Connection, cells: dict[Key, Cell]) -> None:
    """Add cells to the stored ones (see :func:`add`)."""
    if not cells:
        return
    if conn.dialect.name == "postgresql":  # the stored cells are added to in SQL
        cells_json = orjson.dumps([_pg_row(*i) for i in cells.items()]).decode()
        conn.execute(_PG_UPSERT, {"cells": cells_json})
        return
    stored = _stored(conn, list(cells))
    for key, cell in stored.items():
        cell.merge(cells[key])
        cells[key] = cell
    insert = sqlite.insert(usage_daily)
    update = {c: insert.excluded[c] for c in _row((0, "", ""), Cell()) if c not in _KEY}
    upsert = insert.on_conflict_do_update(index_elements=list(_KEY), set_=update)
    conn.execute(upsert, [_row(key, cell) for key, cell in cells.items()])


_KEY = ("day", "dimension", "group_key")
_VALUES = ("requests", "prompt_tokens", "completion_tokens", "errors", "latency_hist")
# PostgreSQL: every cell in one statement, one JSON parameter (a refresh of 10,000 rows
# spread over 90 days writes ~14,000 cells: a pipelined INSERT each cost ~20 µs a cell),
# a stored cell added to in the statement itself: reading the stored cells first (an
# index probe each) and decoding their histograms in Python cost more (RESULTS.md,
# helper 71). Histograms are added bucket by bucket, buckets in numeric order.
_HIST_SUM = (
    "(SELECT coalesce(json_object_agg(b, n ORDER BY b::integer), '{}'::json) FROM ("
    "SELECT key AS b, sum(value::text::bigint) AS n FROM ("
    "SELECT * FROM json_each(usage_daily.latency_hist) "
    "UNION ALL SELECT * FROM json_each(excluded.latency_hist)) AS both_hists "
    "GROUP BY key) AS summed)"
)
_PG_UPSERT = text(
    f"INSERT INTO usage_daily ({', '.join(_KEY + _VALUES)}) "
    f"SELECT {', '.join(_KEY + _VALUES)} FROM json_to_recordset(CAST(:cells AS json)) AS c("
    "day integer, dimension text, group_key text, requests bigint, prompt_tokens bigint, "
    "completion_tokens bigint, errors bigint, latency_hist json) "
    f"ON CONFLICT ({', '.join(_KEY)}) DO UPDATE SET "
    + ", ".join(f"{c} = usage_daily.{c} + excluded.{c}" for c in _VALUES[:-1])
    + f", latency_hist = {_HIST_SUM}"
)


def _pg_row(key: Key, cell: Cell) -> dict[str, Any]:
    row = _row(key, cell)
    row["group_key"] = exact_text.encode(key[2])  # as the column type stores it
    return row


ROLLED = "rolled"


def rolled_seq(conn: Connection) -> int:
    """The last chain position the rollup covers."""
    query = select(usage_progress.c.seq).where(usage_progress.c.name == ROLLED)
    return conn.execute(query).scalar() or 0


def _set_rolled(conn: Connection, seq: int) -> None:
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    insert = dialect.insert(usage_progress).values(name=ROLLED, seq=seq)
    conn.execute(insert.on_conflict_do_update(index_elements=["name"], set_={"seq": seq}))


def rows_between(conn: Connection, after: int, upto: int | None = None):
    """The rollup's columns of the rows after position ``after`` (up to ``upto``),
    in chain order, streamed."""
    query = select(*ROW_SELECT).where(completions.c.seq > after)
    if upto is not None:
        query = query.where(completions.c.seq <= upto)
    options = {"stream_results": True, "yield_per": 5000}
    return conn.execute(query.order_by(completions.c.seq), execution_options=options)


def refresh(conn: Connection, upto: int, known: Known | None = None) -> int:
    """Add the rows after the rollup's position up to ``upto`` (a batch boundary: a
    request's rows are never split) and move the position; returns rows added.
    ``known``: cells of rows from the position on, kept by the writer that stored
    them (chaining.Known); used only when they start exactly at the position."""
    after = rolled_seq(conn)
    if upto <= after:
        return 0
    if known is not None and known.start == after and after < known.end <= upto:
        add_cells(conn, known.cells)
        added = known.end - after + _add_streamed(conn, rows_between(conn, known.end, upto))
    else:
        added = _add_streamed(conn, rows_between(conn, after, upto))
    _set_rolled(conn, upto)
    return added


def _add_streamed(conn: Connection, rows) -> int:
    batch: list[Mapping[str, Any]] = []
    added = 0
    for row in rows:  # a request's rows are consecutive: never split them
        if len(batch) >= 20_000 and _request(row) != _request(batch[-1]):
            add(conn, batch)
            added += len(batch)
            batch = []
        batch.append(row)
    add(conn, batch)
    return added + len(batch)


def rebuild_all(engine) -> int:
    """Recompute the rollup from every row of the table, under the chain lock (the
    owner's: the writer may not delete); returns the number of cells."""
    from lorapool.audit_db.database import write_transaction

    with write_transaction(engine) as conn:
        return rebuild(conn)


def rebuild(conn: Connection, progress: bool = True) -> int:
    """The rollup of every row, from scratch (``progress``: record how far it goes;
    revision 0004 had no place for it)."""
    conn.execute(delete(usage_daily))
    head = conn.execute(select(func.max(completions.c.seq))).scalar() or 0
    _add_streamed(conn, rows_between(conn, 0, head))
    if progress:
        _set_rolled(conn, head)
    return conn.execute(select(func.count()).select_from(usage_daily)).scalar()


def _request(row: Sequence[Any]) -> tuple:
    return row[0], row[1]  # pool, request_id


def read(
    conn: Connection, dimension: str, first_day: int | None, end_day: int | None
) -> dict[str, Cell]:
    """group_key -> usage over the days ``first_day <= day < end_day`` (None: open)."""
    columns = ("group_key", "requests", "prompt_tokens", "completion_tokens", "errors")
    query = select(*(usage_daily.c[c] for c in columns), usage_daily.c.latency_hist)
    query = query.where(usage_daily.c.dimension == dimension)
    if first_day is not None:
        query = query.where(usage_daily.c.day >= first_day)
    if end_day is not None:
        query = query.where(usage_daily.c.day < end_day)
    merged: dict[str, Cell] = {}
    for key, requests, prompt, completion, errors, hist in conn.execute(query).all():
        cell = merged.get(key)
        if cell is None:
            cell = merged[key] = Cell()
        cell.requests += requests
        cell.prompt_tokens += prompt
        cell.completion_tokens += completion
        cell.errors += errors
        merged_hist = cell.latency_hist  # merged here, not through a Cell per row: a
        for b, n in (hist or {}).items():  # month of 500 adapters is 15,000 rows
            b = int(b)
            merged_hist[b] = merged_hist.get(b, 0) + n
    return merged


def _nth(ordered: list[tuple[int, int]], rank: int) -> float:
    """The bucket value of the ``rank``-th smallest latency (0-based)."""
    seen = 0
    for b, n in ordered:
        seen += n
        if seen > rank:
            return bucket_value(b)
    return bucket_value(ordered[-1][0])


def percentile(hist: Mapping[int, int], q: float) -> float | None:
    """The q-th percentile (0..100) of the latencies in ``hist``, by linear
    interpolation between the two ranks around it as ``usage.percentile`` does on
    the values themselves; each within half a bucket (0.5%) of its value."""
    total = sum(hist.values())
    if not total:
        return None
    ordered = sorted(hist.items())
    position = (total - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    below, above = _nth(ordered, low), _nth(ordered, high)
    return below + (above - below) * (position - low)
