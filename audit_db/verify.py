"""Walking the hash chain: does every stored row still match what was written?

Checks every adapter row against its fingerprint, then every completion row in
chain order: positions are consecutive from 1, each row links to the hash of
the one before, and each row's content hashes to its ``row_hash`` (an HMAC
under the audit key from ``audit_meta.keyed_from_seq`` on, so a table
re-chained without the key fails). The first row that fails is named.

A cut-off tail leaves a valid (shorter) chain. Completeness is proved against a
:class:`Head` exported earlier (``lorapool audit head``) and kept elsewhere:
the row at the head's position must still be there with the head's hash.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from sqlalchemy import Connection, Engine, select

from lorapool.audit_db.chain import GENESIS, adapter_fingerprint, link, row_body
from lorapool.audit_db.schema import adapters, completions
from lorapool.audit_db.store import keyed_from

HEAD_VERSION = 1


class HeadError(ValueError):
    """A head file that cannot be read; the message says why."""


@dataclass(frozen=True)
class Head:
    """The chain's last position and hash at one moment (``lorapool audit head``)."""

    seq: int
    row_hash: str
    keyed_from: int | None
    exported_at: float

    def to_json(self) -> bytes:
        return orjson.dumps({"v": HEAD_VERSION, **asdict(self)}, option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Head:
        try:
            data: Any = orjson.loads(raw)
            if data.get("v") != HEAD_VERSION:
                raise HeadError(f"unknown head version {data.get('v')!r}")
            head = cls(
                int(data["seq"]), str(data["row_hash"]), data["keyed_from"], data["exported_at"]
            )
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
            raise HeadError(f"not a head file: {exc}") from None
        if head.seq < 0 or len(head.row_hash) != 64:
            raise HeadError(f"not a head file: seq {head.seq}, row_hash {head.row_hash!r}")
        return head


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
    keyed_from: int | None = None
    problem: str | None = None  # a failure of the whole chain (no key, cut tail)

    @property
    def ok(self) -> bool:
        return self.first_bad is None and self.problem is None

    def head(self) -> Head:
        return Head(self.head_seq, self.head_hash, self.keyed_from, time.time())

    def describe_failure(self) -> str:
        parts = [p for p in (self.first_bad and self.first_bad.describe(), self.problem) if p]
        return "; ".join(parts)


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


def _check_row(
    row, expected_seq: int, prev: str, fingerprints: dict[int, str], key: bytes | None
) -> str | None:
    if row["seq"] != expected_seq:
        return f"chain position {expected_seq} is missing (rows deleted before this one)"
    if row["prev_hash"] != prev:
        return "prev_hash does not match the hash of the row before it"
    fingerprint = fingerprints.get(row["adapter_pk"]) if row["adapter_pk"] is not None else None
    if row["adapter_pk"] is not None and fingerprint is None:
        return f"references adapter pk={row['adapter_pk']}, which does not exist"
    if link(prev, row["seq"], row_body(row, fingerprint), key) != row["row_hash"]:
        if key is not None:
            return (
                "content does not match its row_hash under the audit key (row changed after "
                "it was written, the table was re-chained without the key, or this is not "
                "the key it was written with)"
            )
        return "content does not match its row_hash (row changed after it was written)"
    return None


def _bad(row, reason: str) -> BadRow:
    return BadRow("completions", row["seq"], row["request_id"], row["completion_index"], reason)


def _key_problem(key: bytes | None, start: int | None, last_seq: int) -> str | None:
    if key is None and start is not None:
        return f"rows from seq {start} are keyed: verifying them needs the audit key"
    # keyed_from past the end would leave a re-chained table with nothing keyed to check
    if key is not None and last_seq and (start is None or start > last_seq):
        return (
            f"none of the {last_seq} rows is keyed (written without the audit key, or the "
            "table was re-chained without it)"
        )
    return None


def _head_problem(head: Head | None, report: VerifyReport, hashes: dict[int, str]) -> str | None:
    if head is None or head.seq == 0:
        return None
    if report.head_seq < head.seq:
        return (
            f"the chain ends at seq {report.head_seq} but the exported head is at seq "
            f"{head.seq}: {head.seq - report.head_seq} rows are missing from the tail"
        )
    if hashes.get(head.seq) != head.row_hash:
        return (
            f"row seq={head.seq} does not have the exported head's hash (the chain was rewritten)"
        )
    return None


def verify_chain(
    engine: Engine,
    key: bytes | None = None,
    head: Head | None = None,
    page_size: int = 2000,
) -> VerifyReport:
    """Walk the whole chain; returns a report naming the first bad row, if any.

    ``key``: the audit key; rows from ``keyed_from_seq`` on are checked with it
    (without it the report fails, saying the key is needed). ``head``: an
    earlier export; the chain must still reach it with its hash.
    """
    with engine.connect() as conn:
        start = keyed_from(conn)
        fingerprints, first_bad = _adapter_fingerprints(conn)
        num_rows, seq, prev, at_head = 0, 0, GENESIS, {}
        for row in _pages(conn, page_size):
            keyed = start is not None and row["seq"] >= start
            if keyed and key is None:
                reason = None  # cannot be checked: the report says the key is needed
            else:
                reason = _check_row(row, seq + 1, prev, fingerprints, key if keyed else None)
            if reason is not None and first_bad is None:
                first_bad = _bad(row, reason)
            num_rows += 1
            seq, prev = row["seq"], row["row_hash"]
            if head is not None and seq == head.seq:
                at_head[seq] = prev
    report = VerifyReport(num_rows, len(fingerprints), seq, prev, first_bad, start)
    problem = _key_problem(key, start, seq) or _head_problem(head, report, at_head)
    return VerifyReport(num_rows, len(fingerprints), seq, prev, first_bad, start, problem)
