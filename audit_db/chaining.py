"""Prepared rows chained onto a head: now, under the chain lock (store.py), or ahead of
time, while the server inserts the batch before (:func:`ahead`).

A row's stored values and hash are a function of the row, its adapter's pk, the head
it follows, the audit key and the period: nothing else. So the writer may chain and
encode its next batch onto the end of the batch being inserted, before that one has
committed, and use the result only if, under the lock, every one of those inputs is
what it assumed (:meth:`Ahead.holds`): the head is the last row it chained onto (not
when the batch before rolled back or another writer wrote since), every row is fresh
(a redelivered row makes the set differ), the pks and the period are the same. Else
the rows are chained again, as if nothing had been done ahead. The database's checks
after the COPY (store._insert_chained) and the guard are unchanged. What the rows add
to the usage rollup is counted then too (``Ahead.usage``): the writer keeps it for the
next refresh when they went in as chained (:class:`Known`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorapool.audit_db import bulk, rollup
from lorapool.audit_db.chain import COMPACT_VERSION, link, link_v2
from lorapool.audit_db.guard import ChainGuard, Head
from lorapool.audit_db.rows import PreparedRow


def stored_values(row: PreparedRow, seq: int, prev: str, row_hash: str, pk, period) -> dict:
    values = {**row.values, "seq": seq, "adapter_pk": pk, "prev_hash": prev, "row_hash": row_hash}
    values["chain_version"], values["period"] = row.version, period
    if row.version == COMPACT_VERSION:  # stored as hashed: the packed bytes
        values["prompt_tokens"], values["output_tokens"] = row.tokens
        values["prompt_token_ids"] = values["token_ids"] = None
    else:
        values["prompt_tokens"] = values["output_tokens"] = None
    return values


def chain(
    rows: list[PreparedRow], pks: dict[str, int], head: Head, key: bytes | None, period: int
) -> list[dict]:
    """The rows' stored values, each linked to the one before, from ``head`` on."""
    chained, seq, prev = [], head.seq, head.row_hash
    for row in rows:
        seq += 1
        if row.version == COMPACT_VERSION:
            row_hash = link_v2(prev, seq, row.body, row.tokens, key)
        else:
            row_hash = link(prev, seq, row.body, key)
        pk = pks[row.adapter["fingerprint"]] if row.adapter else None
        chained.append(stored_values(row, seq, prev, row_hash, pk, period))
        prev = row_hash
    return chained


def _fingerprints(rows: Iterable[PreparedRow]) -> set[str]:
    return {row.adapter["fingerprint"] for row in rows if row.adapter}


@dataclass(frozen=True)
class Ahead:
    """A batch chained and encoded before its transaction (see the module docstring)."""

    rows: list[PreparedRow]
    head: Head  # the head it was chained onto: the end of the batch then being inserted
    key: bytes | None
    pks: dict[str, int]  # the pks it used, of its rows' adapters
    chained: list[dict]
    encoded: list[bytes]  # bulk.encode's COPY chunks of ``chained``
    usage: dict  # what ``chained`` adds to the usage rollup (rollup.Known)

    def holds(
        self, fresh: list[PreparedRow], pks: dict[str, int], head: Head, key, period: int
    ) -> bool:
        """True when chaining ``fresh`` now would give exactly ``chained``."""
        return (
            len(fresh) == len(self.rows)
            and all(a is b for a, b in zip(fresh, self.rows, strict=True))
            and (head.seq, head.row_hash) == (self.head.seq, self.head.row_hash)
            and period == self.head.period
            and key == self.key
            and all(pks.get(fp) == pk for fp, pk in self.pks.items())
        )


def ahead(rows: list[PreparedRow], guard: ChainGuard) -> Ahead | None:
    """``rows`` chained onto the batch ``guard`` is inserting now (``guard.sending``)
    and encoded; None when nothing is being inserted, an adapter's pk is not known yet
    or a value cannot be encoded (the store then chains them as usual, and refuses what
    it must)."""
    head = guard.sending
    if head is None or not rows:
        return None
    known = guard.known_pks()
    wanted = _fingerprints(rows)
    if not wanted <= known.keys():
        return None
    pks = {fp: known[fp] for fp in wanted}
    chained = chain(rows, pks, head, guard.key, head.period)
    try:
        encoded = bulk.encode(chained)
    except bulk.Unencodable:
        return None
    return Ahead(rows, head, guard.key, pks, chained, encoded, cells_of_values(chained))


def cells_of_values(rows: Iterable[Mapping[str, Any]]) -> dict[rollup.Key, rollup.Cell]:
    """The cells of chained rows' stored values: what ``rollup.refresh`` would read back
    for them (the writer's own rows, in memory, see :class:`Known`)."""
    return rollup.cells_of(
        rollup.requests_of([tuple(row[c] for c in rollup.ROW_COLUMNS) for row in rows])
    )


@dataclass
class Known:
    """The cells of the chain's rows ``start < seq <= end``, all stored by one writer
    that kept them as it went (their batches in turn, each made while the server
    inserted the one before): ``rollup.refresh`` from ``start`` adds them instead of
    reading those rows back (~20 µs a row at 10,000 rows a refresh, RESULTS.md)."""

    start: int
    end: int
    cells: dict[rollup.Key, rollup.Cell] = field(default_factory=dict)

    def extend(self, after: int, end: int, cells: dict[rollup.Key, rollup.Cell]) -> bool:
        """Add the cells of rows ``after < seq <= end``; False (nothing added) when they
        do not follow on."""
        if after != self.end:
            return False
        for key, cell in cells.items():
            mine = self.cells.get(key)
            if mine is None:
                self.cells[key] = cell
            else:
                mine.merge(cell)
        self.end = end
        return True
