"""Walking a stretch of the hash chain: rows in, the first bad one (if any) out.

One walker serves ``audit verify`` (the whole chain, or from a checkpoint), the
writer's check before it extends the chain, and archive files (offline): a
:class:`Walk` starts at a trusted (position, hash), takes rows in chain order and
checks each one: its position is the next, it links to the hash before it, its
content hashes to its ``row_hash`` (under the audit key from ``keyed_from`` on)
and its adapter exists; where a checkpoint names a position, the row there must
have the checkpoint's hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, LargeBinary, func, select, type_coerce

from lorapool.audit_db.chain import GENESIS, row_hash
from lorapool.audit_db.schema import completions
from lorapool.audit_db.tokens import TokenArray

STREAM_ROWS = 2000  # rows a server-side cursor hands over at a time


@dataclass(frozen=True)
class BadRow:
    """The first row that does not match; ``table`` is "adapters" or "completions"."""

    table: str
    key: int
    request_id: str | None
    completion_index: int | None
    reason: str

    def describe(self) -> str:
        if self.table == "adapters":
            return f"adapters row pk={self.key}: {self.reason}"
        return (
            f"completions row seq={self.key} (request {self.request_id!r}, "
            f"completion {self.completion_index}): {self.reason}"
        )


def _bad(row: Mapping[str, Any], reason: str) -> BadRow:
    return BadRow("completions", row["seq"], row["request_id"], row["completion_index"], reason)


@dataclass
class Walk:
    """A walk along the chain from (``seq``, ``row_hash``), a trusted position.

    ``key``: the audit key (None: rows are checked as unkeyed sha256 links, and
    keyed rows cannot be checked). ``keyed_from``: the first keyed position.
    ``fingerprints``: adapter pk -> fingerprint. ``marks``: position -> hash that
    the row there must have (the checkpoints').
    """

    seq: int = 0
    row_hash: str = GENESIS
    key: bytes | None = None
    keyed_from: int | None = None
    fingerprints: dict[int, str] = field(default_factory=dict)
    marks: dict[int, str] = field(default_factory=dict)
    num_rows: int = 0
    first_bad: BadRow | None = None

    def reason(self, row: Mapping[str, Any]) -> str | None:
        """Why ``row`` (logical or stored, see chain.row_hash) does not follow; None if it
        does."""
        if row["seq"] != self.seq + 1:
            return f"chain position {self.seq + 1} is missing (rows deleted before this one)"
        if row["prev_hash"] != self.row_hash:
            return "prev_hash does not match the hash of the row before it"
        pk = row["adapter_pk"]
        fingerprint = self.fingerprints.get(pk) if pk is not None else None
        if pk is not None and fingerprint is None:
            return f"references adapter pk={pk}, which does not exist"
        keyed = self.keyed_from is not None and row["seq"] >= self.keyed_from
        if keyed and self.key is None:
            return None  # cannot be checked: the report says the key is needed
        if (
            row_hash(row, self.row_hash, fingerprint, self.key if keyed else None)
            != row["row_hash"]
        ):
            if keyed:
                return (
                    "content does not match its row_hash under the audit key (row changed "
                    "after it was written, the table was re-chained without the key, or this "
                    "is not the key it was written with)"
                )
            return "content does not match its row_hash (row changed after it was written)"
        mark = self.marks.get(row["seq"])
        if mark is not None and mark != row["row_hash"]:
            return "does not have the hash its signed checkpoint gives (the chain was rewritten)"
        return None

    def take(self, row: Mapping[str, Any]) -> bool:
        """Check one row and move on past it; False once a row was bad."""
        if self.first_bad is None:
            reason = self.reason(row)
            if reason is not None:
                self.first_bad = _bad(row, reason)
        self.num_rows += 1
        self.seq, self.row_hash = row["seq"], row["row_hash"]
        return self.first_bad is None

    def take_all(self, rows: Iterable[Mapping[str, Any]], stop_at_bad: bool = False) -> None:
        for row in rows:
            if not self.take(row) and stop_at_bad:
                return


_PACKED = [  # a walk hashes the compact token ids as stored: no lists made of them
    type_coerce(c, LargeBinary).label(c.name) if isinstance(c.type, TokenArray) else c
    for c in completions.columns
]


def rows_after(
    conn: Connection,
    seq: int,
    until: int | None = None,
    page: int = STREAM_ROWS,
    packed: bool = False,
) -> Iterator[Mapping[str, Any]]:
    """Completion rows after position ``seq`` (up to ``until``), in chain order, from
    a server-side cursor: memory stays bounded at any table size. ``packed``: compact
    token ids as their stored bytes (for a walk), not lists."""
    query = select(*_PACKED) if packed else select(completions)
    query = query.where(completions.c.seq > seq).order_by(completions.c.seq)
    if until is not None:
        query = query.where(completions.c.seq <= until)
    options = {"stream_results": True, "yield_per": page}  # this statement's, not the connection's
    yield from conn.execute(query, execution_options=options).mappings()


def online_range(conn: Connection) -> tuple[int, int, int]:
    """(first position, last position, rows) of the rows still in the table; (0, 0, 0)
    when it is empty."""
    first = conn.execute(select(func.min(completions.c.seq))).scalar()
    if first is None:
        return 0, 0, 0
    last = conn.execute(select(func.max(completions.c.seq))).scalar()
    return first, last, last - first + 1


def hashes_at(conn: Connection, positions: list[int]) -> dict[int, str]:
    """position -> stored row_hash, for the rows at ``positions`` that exist."""
    found: dict[int, str] = {}
    for start in range(0, len(positions), 1000):
        chunk = positions[start : start + 1000]
        query = select(completions.c.seq, completions.c.row_hash).where(
            completions.c.seq.in_(chunk)
        )
        found.update(conn.execute(query).all())
    return found
