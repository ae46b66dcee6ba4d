"""The append path: audit records in, chained rows out. There is no other write.

:func:`prepare` turns one record into its rows (hash bodies included) outside
any transaction; :func:`append` stores prepared rows in one transaction under
the audit write lock, so rows from concurrent writers get consecutive chain
positions. A row whose key (pool, request id, completion index) is already
stored is skipped when it says the same thing (a redelivery) and recorded in
``conflicts`` when it does not: never silently dropped. The rows go in with
one COPY (PostgreSQL) or one ``executemany`` (SQLite, where the insert is also
``ON CONFLICT DO NOTHING``), see bulk.py. With the audit key the chain is keyed from the first
keyed write on (``audit_meta.keyed_from_seq``); a writer without the key
cannot extend a keyed chain. Before it adds a row, :class:`~.guard.ChainGuard`
checks the chain from its last signed checkpoint and afterwards adds the
checkpoints that are due (guard.py). Rows whose token ids fit int32 are written
as compact chain version 2 rows (chain.py, tokens.py); a row's ``period`` is its
month, never less than the row before's (partitions.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Integer,
    Text,
    column,
    func,
    select,
    true,
)
from sqlalchemy.dialects import postgresql, sqlite

from lorapool.audit_db import exact_text, partitions, rollup
from lorapool.audit_db.bulk import bulk_insert, wanted_rows
from lorapool.audit_db.chain import GENESIS, content_digest, logical
from lorapool.audit_db.chaining import Ahead, Known, chain
from lorapool.audit_db.checkpoints import Checkpoint
from lorapool.audit_db.database import write_transaction
from lorapool.audit_db.guard import (
    KEYED_FROM,
    ChainGuard,
    ChainTampered,
    Head,
    KeyedChainError,
    keyed_from,
)
from lorapool.audit_db.rows import PreparedRow, prepare
from lorapool.audit_db.schema import adapters, completions, conflicts
from lorapool.lifecycle.keys import DEFAULT_PREFIX
from lorapool.records.audit import AuditRecord


class ChainError(RuntimeError):
    """The chain could not be extended consistently; the transaction was rolled back."""


@dataclass(frozen=True)
class Conflict:
    """A row refused because a different row is stored (or kept) under its key."""

    row: PreparedRow
    stored_digest: str


@dataclass
class AppendResult:
    """What :func:`append` did: rows written, redeliveries skipped, conflicts recorded."""

    written: int = 0
    duplicates: int = 0
    conflicts: list[Conflict] = field(default_factory=list)
    chained_ahead: bool = False  # the rows went in as chained ahead (``early``)


def _insert(conn: Connection, table, rows: list[dict[str, Any]], key: list[str]) -> None:
    """INSERT ... ON CONFLICT DO NOTHING, as one executemany (psycopg pipelines it)."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    conn.execute(dialect.insert(table).on_conflict_do_nothing(index_elements=key), rows)


def _adapter_pks(conn: Connection, rows: list[PreparedRow], known: dict[str, int]) -> dict:
    """fingerprint -> pk of the rows' adapters, stored first where new. ``known``: the
    pks this writer already has (an adapter row never changes): only the others are
    looked up; returns those."""
    wanted = {r.adapter["fingerprint"]: r.adapter for r in rows if r.adapter}
    wanted = {fp: a for fp, a in wanted.items() if fp not in known}
    if not wanted:
        return {}
    by_columns: dict[tuple, list] = {}  # rows with and without the 0008 hashes
    for adapter in wanted.values():
        by_columns.setdefault(tuple(adapter), []).append(adapter)
    for group in by_columns.values():
        _insert(conn, adapters, group, ["fingerprint"])
    found = conn.execute(
        select(adapters.c.fingerprint, adapters.c.pk).where(
            adapters.c.fingerprint.in_(list(wanted))
        )
    )
    return dict(found.all())


def _stored_digests(conn: Connection, rows: list[PreparedRow]) -> dict[tuple, str]:
    """The content digest of every stored row that has the key of one of ``rows``."""
    wanted = {r.key for r in rows}
    if conn.dialect.name == "postgresql":
        query = _keys_lookup(sorted(wanted, key=_sortable))
    else:
        ids, pools = sorted({k[1] for k in wanted}), sorted({k[0] for k in wanted})
        where = (completions.c.request_id.in_(ids), completions.c.pool.in_(pools))
        query = (
            select(completions, adapters.c.fingerprint)
            .select_from(completions.outerjoin(adapters, completions.c.adapter_pk == adapters.c.pk))
            .where(*where)  # request_id leads the unique index: an index lookup
        )
    stored = {}
    for row in conn.execute(query).mappings():
        key = (row["pool"], row["request_id"], row["completion_index"])
        if key in wanted:
            stored[key] = content_digest(logical(row), row["fingerprint"])
    return stored


def _sortable(key: tuple) -> tuple:
    return ("" if key[0] is None else key[0], key[1], key[2])


def _keys_lookup(keys: list[tuple]):
    """PostgreSQL: the rows with these keys, one index probe per key (a LATERAL join
    with LIMIT 1: a nested loop whatever the statistics say). ``request_id = ANY(500
    ids)`` was planned as a scan of the whole partition wherever it had no statistics
    (this test server runs without autovacuum; a month's new partition has none until
    autovacuum analyzes it): 0.5% of the rows for each id, so 500 ids looked like all
    of them, and a batch read the table (314 ms at 200,000 rows). The keys go as one
    JSON parameter: three 500-element arrays cost psycopg ~1,500 Python calls a batch."""
    encoded = [
        {"pool": exact_text.encode(k[0]), "request_id": exact_text.encode(k[1]), "idx": k[2]}
        for k in keys
    ]
    wanted = wanted_rows(
        encoded, column("pool", Text), column("request_id", Text), column("idx", Integer)
    )
    one = (
        select(completions)
        .where(
            completions.c.request_id == wanted.c.request_id,
            completions.c.completion_index == wanted.c.idx,
            completions.c.pool == wanted.c.pool,
        )
        .limit(1)  # the key is unique (the writer keeps it so under the chain lock)
        .lateral("stored")
    )
    found = wanted.join(one, true()).outerjoin(adapters, one.c.adapter_pk == adapters.c.pk)
    return select(one, adapters.c.fingerprint).select_from(found)


def chain_head(conn: Connection) -> Head:
    """Position, hash and period of the last row in the chain; ``Head()`` when empty."""
    query = (
        select(completions.c.seq, completions.c.row_hash, completions.c.period)
        .order_by(completions.c.seq.desc())
        .limit(1)
    )
    head = conn.execute(query).first()
    return Head(*head) if head else Head()


def _sort_out(
    rows: list[PreparedRow], stored: dict[tuple, str]
) -> tuple[list[PreparedRow], AppendResult]:
    """The rows to store, and the result so far (duplicates and conflicts counted)."""
    kept: dict[tuple, PreparedRow] = {}
    fresh, result = [], AppendResult()
    for row in rows:
        earlier = kept.get(row.key)
        digest = stored.get(row.key) or (earlier.digest if earlier else None)
        if digest is None:
            kept[row.key] = row
            fresh.append(row)
        elif digest == row.digest:
            result.duplicates += 1
        else:
            result.conflicts.append(Conflict(row, digest))
    return fresh, result


def _record_conflicts(conn: Connection, found: list[Conflict], now: float) -> None:
    if not found:
        return
    conn.execute(
        conflicts.insert(),
        [
            {
                "pool": c.row.key[0],
                "request_id": c.row.key[1],
                "completion_index": c.row.key[2],
                "stored_digest": c.stored_digest,
                "refused_digest": c.row.digest,
                "refused_row": {**c.row.values, "adapter": c.row.adapter},
                "source": c.row.source,
                "detected_at": now,
            }
            for c in found
        ],
    )


def _insert_chained(
    conn: Connection, rows: list[dict[str, Any]], head: Head, meanwhile, encoded=None
) -> None:
    """COPY the chained rows, then check that the chain now ends with exactly them
    (cannot fail under the lock; never leave a gap). Both reads are index look-ups
    whatever the statistics: an open ``seq > head`` (a third of the table to a planner
    without statistics) was a scan of the whole partition at every batch, the writer's
    cost growing with the table (190 ms a batch at 200,000 rows)."""
    bulk_insert(conn, rows, meanwhile, encoded)  # not every driver's row count is reliable: count
    last = rows[-1]
    window = (completions.c.seq > head.seq) & (completions.c.seq <= last["seq"])
    added = conn.execute(select(func.count()).where(window)).scalar()
    now = chain_head(conn)
    if added != len(rows) or (now.seq, now.row_hash) != (last["seq"], last["row_hash"]):
        raise ChainError(
            f"expected {len(rows)} new rows after seq {head.seq} ending at {last['seq']}, "
            f"got {added} ending at {now.seq}"
        )


def _period(conn: Connection, guard: ChainGuard, head: Head, now: float) -> int:
    """The period of the rows about to be written; its partition (and the next
    month's) made when this guard has not seen it yet."""
    period = max(partitions.period_of(now), head.period)
    if period not in guard.periods:
        partitions.ensure(conn, period)
        partitions.ensure(conn, partitions.next_period(period))
        guard.periods.add(period)
    return period


def _extend(
    conn: Connection,
    fresh: list[PreparedRow],
    guard: ChainGuard,
    now: float,
    meanwhile,
    early: Ahead | None,
) -> bool:
    """Chain and insert the fresh rows; True when they went in as chained ahead."""
    pks = {**guard.adapter_pks, **guard.new_adapters(_adapter_pks(conn, fresh, guard.adapter_pks))}
    head = chain_head(conn)
    guard.check(conn, head)
    guard.start_keyed(conn, head)
    period = _period(conn, guard, head, now)
    guard.before_period(conn, head, period)
    held = early is not None and early.holds(fresh, pks, head, guard.key, period)
    if held:
        chained, encoded = early.chained, early.encoded
    else:
        chained, encoded = chain(fresh, pks, head, guard.key, period), None
    guard.sending = Head(chained[-1]["seq"], chained[-1]["row_hash"], period)
    _insert_chained(conn, chained, head, meanwhile, encoded)
    last = chained[-1]
    guard.after_rows(conn, Head(last["seq"], last["row_hash"], period), now)
    return held


def append(
    engine: Engine,
    rows: list[PreparedRow],
    key: bytes | None = None,
    guard: ChainGuard | None = None,
    now: float | None = None,
    meanwhile: Callable[[], bool] | None = None,
    early: Ahead | None = None,
) -> AppendResult:
    """Store the rows not stored yet, chained (keyed with ``key``), in one transaction.

    Rows that repeat a stored row are counted as duplicates; rows that
    contradict one are recorded in ``conflicts`` (and returned), not stored.
    ``guard`` (a writer keeps one) checks the chain before it is extended and
    writes checkpoints; without it a fresh one is used, which verifies from the
    newest checkpoint. Raises :class:`ChainTampered` when the chain does not verify.
    ``now`` (default: the time) sets the rows' period: tests and imports of old rows.
    ``meanwhile``: the caller's work for while the server inserts the rows (a slice a
    call, False once none is left; see bulk.py); it must not use the database.
    ``early``: these rows chained and encoded ahead of time (chaining.py), used when
    it holds under the lock.
    """
    if not rows:
        return AppendResult()
    guard = guard or ChainGuard(key)
    try:
        with write_transaction(engine) as conn:
            fresh, result = _sort_out(rows, _stored_digests(conn, rows))
            _record_conflicts(conn, result.conflicts, time.time())
            if fresh:
                at = time.time() if now is None else now
                result.chained_ahead = _extend(conn, fresh, guard, at, meanwhile, early)
    except BaseException:
        guard.rolled_back()
        raise
    guard.committed()
    result.written = len(fresh)
    return result


def refresh_rollup(engine: Engine, known: Known | None = None) -> int:
    """Bring the usage rollup up to the chain's head (rollup.py), under the chain lock;
    returns the rows it added. ``known``: the cells a writer kept of its own rows."""
    with write_transaction(engine) as conn:
        return rollup.refresh(conn, chain_head(conn).seq, known)


def check_chain(engine: Engine, guard: ChainGuard) -> None:
    """Check, under the chain lock, that the chain verifies from its last checkpoint
    (a writer does it as it starts); raises :class:`ChainTampered` when not."""
    try:
        with write_transaction(engine) as conn:
            guard.check(conn, chain_head(conn))
    except BaseException:
        guard.rolled_back()
        raise


def checkpoint_now(
    engine: Engine, key: bytes, guard: ChainGuard | None = None, adopt: bool = False
) -> Checkpoint | None:
    """Check the chain from its last checkpoint, then add a checkpoint at its head.

    ``adopt``: the chain has rows but no checkpoint and none of its rows is keyed
    (written without the key): verify it as it is and make it the start of the
    keyed chain (a key holder's decision, see guard.py). Returns the checkpoint
    made (None for an empty chain).
    """
    guard = guard or ChainGuard(key)
    try:
        with write_transaction(engine) as conn:
            head = chain_head(conn)
            if adopt:
                guard.adopt(conn, head)
            else:
                guard.check(conn, head)
                if head.seq:
                    guard.add(conn, head, time.time())
    except BaseException:
        guard.rolled_back()
        raise
    made = guard.committed()
    return made[-1] if made else None


def append_records(
    engine: Engine,
    records: list[AuditRecord],
    pool: str = DEFAULT_PREFIX,
    key: bytes | None = None,
) -> int:
    """Prepare and store records (a convenience for tests and one-off imports)."""
    rows = [row for record in records for row in prepare(record, pool)]
    return append(engine, rows, key).written


__all__ = [
    "KEYED_FROM",
    "AppendResult",
    "ChainGuard",
    "ChainTampered",
    "Conflict",
    "ChainError",
    "GENESIS",
    "KeyedChainError",
    "PreparedRow",
    "append",
    "append_records",
    "chain_head",
    "check_chain",
    "refresh_rollup",
    "checkpoint_now",
    "keyed_from",
    "prepare",
]
