"""Walking the hash chain: does every stored row still match what was written?

Checks every adapter row against its fingerprint, then every completion row in
chain order: positions are consecutive from 1, each row links to the hash of
the one before, and each row's content hashes to its ``row_hash``. The first
row that fails is named. A cut-off tail leaves a valid (shorter) chain: keep
the reported head (seq, hash) somewhere else to detect that.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, select

from lorapool.audit_db.chain import GENESIS, adapter_fingerprint, link, row_body
from lorapool.audit_db.schema import adapters, completions


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


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify_chain`; ``ok`` is False when ``first_bad`` is set."""

    num_rows: int
    num_adapters: int
    head_seq: int
    head_hash: str
    first_bad: BadRow | None

    @property
    def ok(self) -> bool:
        return self.first_bad is None


def _adapter_fingerprints(conn: Connection) -> tuple[dict[int, str], BadRow | None]:
    fingerprints, bad = {}, None
    for row in conn.execute(select(adapters).order_by(adapters.c.pk)).mappings():
        fingerprint = adapter_fingerprint(row)
        fingerprints[row["pk"]] = fingerprint
        if bad is None and fingerprint != row["fingerprint"]:
            bad = BadRow(
                "adapters",
                row["pk"],
                None,
                None,
                "identity fields do not match the stored fingerprint",
            )
    return fingerprints, bad


def _pages(conn: Connection, page_size: int) -> Iterator[dict]:
    last = 0
    while True:
        query = (
            select(completions)
            .where(completions.c.seq > last)
            .order_by(completions.c.seq)
            .limit(page_size)
        )
        rows = conn.execute(query).mappings().all()
        if not rows:
            return
        yield from rows
        last = rows[-1]["seq"]


def _check_row(row, expected_seq: int, prev: str, fingerprints: dict[int, str]) -> str | None:
    if row["seq"] != expected_seq:
        return f"chain position {expected_seq} is missing (rows deleted before this one)"
    if row["prev_hash"] != prev:
        return "prev_hash does not match the hash of the row before it"
    fingerprint = fingerprints.get(row["adapter_pk"]) if row["adapter_pk"] is not None else None
    if row["adapter_pk"] is not None and fingerprint is None:
        return f"references adapter pk={row['adapter_pk']}, which does not exist"
    if link(prev, row["seq"], row_body(row, fingerprint)) != row["row_hash"]:
        return "content does not match its row_hash (row changed after it was written)"
    return None


def _bad(row, reason: str) -> BadRow:
    return BadRow("completions", row["seq"], row["request_id"], row["completion_index"], reason)


def verify_chain(engine: Engine, page_size: int = 2000) -> VerifyReport:
    """Walk the whole chain; returns a report naming the first bad row, if any."""
    with engine.connect() as conn:
        fingerprints, first_bad = _adapter_fingerprints(conn)
        num_rows, seq, prev = 0, 0, GENESIS
        for row in _pages(conn, page_size):
            reason = _check_row(row, seq + 1, prev, fingerprints)
            if reason is not None and first_bad is None:
                first_bad = _bad(row, reason)
            num_rows += 1
            seq, prev = row["seq"], row["row_hash"]
    return VerifyReport(num_rows, len(fingerprints), seq, prev, first_bad)
