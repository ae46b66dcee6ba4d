"""Verifying the audit trail: the whole chain, or only the rows since a checkpoint.

Both modes check every signed checkpoint (signature, link to the one before, the
keyed start they all state, and that the row at each checkpoint's position still
has its hash: a re-chained table fails here even where no row is walked), the
archive manifests that account for the months moved out (signed, one after the
other from row 1 to the first row still in the table), every adapter row against
its fingerprint, and then walk rows in chain order (see walk.py): the full walk
from the oldest row online, the incremental one from a checkpoint (``since``).
The first row that fails is named.

A cut-off tail leaves a valid shorter chain unless a checkpoint lies beyond it.
A :class:`Head` exported earlier (``lorapool audit head``, or a checkpoint file
the writer exported) and kept elsewhere proves more: the row at its position
must still be there with its hash.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import orjson
from sqlalchemy import Connection, Engine

from lorapool.audit_db import archive_manifest, checkpoints
from lorapool.audit_db.chain import GENESIS, adapter_fingerprint
from lorapool.audit_db.checkpoints import Checkpoint, CheckpointError
from lorapool.audit_db.guard import adapter_rows, keyed_from
from lorapool.audit_db.walk import BadRow, Walk, hashes_at, online_range, rows_after

HEAD_VERSION = 1
Progress = Callable[[Walk, int], object]  # (the walk so far, rows it has to walk in all)


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
        """A head file, or a checkpoint file (whose signature :func:`verify_chain` checks)."""
        try:
            data: Any = orjson.loads(raw)
            if isinstance(data, dict) and "checkpoint" in data:
                point = Checkpoint.from_json(raw)
                return SignedHead(
                    point.seq, point.row_hash, point.keyed_from, point.created_at, point
                )
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
class SignedHead(Head):
    """A head read from a checkpoint file: signed with the audit key."""

    checkpoint: Checkpoint | None = None


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify_chain`; ``ok`` is False when anything failed.

    ``num_rows``: rows walked (from ``start_seq`` + 1 to ``head_seq``);
    ``verified_checkpoint``: the newest checkpoint the walk reached and matched
    (where the next incremental verify may start); ``newest_checkpoint_at``: when the
    newest checkpoint was made (a writer checkpoints at least daily).
    """

    num_rows: int
    num_adapters: int
    head_seq: int
    head_hash: str
    first_bad: BadRow | None
    keyed_from: int | None = None
    problem: str | None = None  # a failure of the whole chain (no key, cut tail, ...)
    start_seq: int = 0
    num_checkpoints: int = 0
    verified_checkpoint: Checkpoint | None = None
    newest_checkpoint_at: float | None = None
    archived_rows: int = 0

    @property
    def ok(self) -> bool:
        return self.first_bad is None and self.problem is None

    def head(self) -> Head:
        return Head(self.head_seq, self.head_hash, self.keyed_from, time.time())

    def describe_failure(self) -> str:
        parts = [p for p in (self.first_bad and self.first_bad.describe(), self.problem) if p]
        return "; ".join(parts)


@dataclass
class _Facts:
    """What the walk needs to know before it starts, and the first problem found."""

    checkpoints: list[Checkpoint] = field(default_factory=list)
    keyed_from: int | None = None
    fingerprints: dict[int, str] = field(default_factory=dict)
    start: tuple[int, str] = (0, GENESIS)
    first_online: int = 0
    last_online: int = 0
    archived_rows: int = 0
    problems: list[str] = field(default_factory=list)
    bad_adapter: BadRow | None = None
    signed: bool = False  # every checkpoint is signed and links to the one before


def _adapters(conn: Connection, facts: _Facts) -> None:
    for row in adapter_rows(conn):
        fingerprint = adapter_fingerprint(row)
        facts.fingerprints[row["pk"]] = fingerprint
        if facts.bad_adapter is None and fingerprint != row["fingerprint"]:
            reason = "identity fields do not match the stored fingerprint"
            facts.bad_adapter = BadRow("adapters", row["pk"], None, None, reason)


def _checkpoints(conn: Connection, key: bytes | None, facts: _Facts) -> None:
    facts.checkpoints = checkpoints.every(conn)
    meta = keyed_from(conn)
    facts.keyed_from = facts.checkpoints[-1].keyed_from if facts.checkpoints else meta
    if not facts.checkpoints:
        return
    if key is None:
        facts.problems.append(
            "the chain has signed checkpoints: verifying them needs the audit key"
        )
        return
    before = None
    for point in facts.checkpoints:
        problem = point.problem(key, before)
        if problem is not None:
            facts.problems.append(problem)
            return
        before = point
    facts.signed = True
    if meta != facts.keyed_from:
        facts.problems.append(
            f"audit_meta says the chain is keyed from row {meta}, its signed checkpoints say "
            f"{facts.keyed_from} (a key downgrade)"
        )


def _marks(conn: Connection, facts: _Facts) -> dict[int, str]:
    """Position -> hash of each checkpoint on a row still online; a row that lost its
    checkpoint's hash (or a checkpoint past the last row) is a problem."""
    online = [p for p in facts.checkpoints if p.seq >= max(facts.first_online, 1)]
    marks = {p.seq: p.row_hash for p in online}
    stored = hashes_at(conn, sorted(marks))
    for point in online:
        if point.seq > facts.last_online:
            facts.problems.append(
                f"checkpoint {point.id} is at row {point.seq} but the chain ends at row "
                f"{facts.last_online}: {point.seq - facts.last_online} rows are missing from "
                "the tail"
            )
            break
        if stored.get(point.seq) != point.row_hash:
            facts.problems.append(
                f"row {point.seq} does not have the hash of signed checkpoint {point.id} "
                "(the chain was rewritten)"
            )
            break
    return marks


def _facts(conn: Connection, key: bytes | None) -> _Facts:
    facts = _Facts()
    _checkpoints(conn, key, facts)
    facts.first_online, facts.last_online, _ = online_range(conn)
    if key is not None and not facts.checkpoints and facts.keyed_from is not None:
        facts.problems.append(
            f"rows from {facts.keyed_from} on are keyed, yet the chain has no signed "
            "checkpoint: they were removed (or the database was upgraded from revision 0002 "
            "and neither the writer nor `lorapool audit checkpoint` has run since)"
        )
    start, archived, problem = archive_manifest.online_start(conn, key, facts.first_online)
    facts.start, facts.archived_rows = start, archived
    if problem is not None:
        facts.problems.append(problem)
    _adapters(conn, facts)
    return facts


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


def _head_problem(head: Head | None, key: bytes | None, last: int, hashes: dict) -> str | None:
    if head is None or head.seq == 0:
        return None
    point = getattr(head, "checkpoint", None)
    if point is not None and (key is None or not checkpoints.signed_by(point, key)):
        return "the checkpoint file is not signed with the audit key"
    if last < head.seq:
        return (
            f"the chain ends at seq {last} but the exported head is at seq "
            f"{head.seq}: {head.seq - last} rows are missing from the tail"
        )
    if hashes.get(head.seq, head.row_hash) != head.row_hash:
        return (
            f"row seq={head.seq} does not have the exported head's hash (the chain was rewritten)"
        )
    return None


def _start(facts: _Facts, since: int | None, resume: tuple[int, str] | None) -> tuple[int, str]:
    if resume is not None and resume[0] >= facts.start[0]:
        return resume
    if since is None:
        return facts.start
    point = next((p for p in facts.checkpoints if p.id == since), None)
    if point is None:
        raise CheckpointError(f"there is no checkpoint {since}")
    return (point.seq, point.row_hash) if point.seq >= facts.start[0] else facts.start


def verify_chain(
    engine: Engine,
    key: bytes | None = None,
    head: Head | None = None,
    since: int | None = None,
    resume: tuple[int, str] | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Verify the chain; returns a report naming the first bad row, if any.

    ``key``: the audit key; rows from the keyed start on are checked with it
    (without it the report fails, saying the key is needed). ``head``: an earlier
    export; the chain must still reach it with its hash. ``since``: a checkpoint
    id; walk only the rows after it (every checkpoint is still checked).
    ``resume``: (position, hash) an earlier full walk reached; walk on from there.
    ``progress(walk, total)`` is called every few thousand rows (``walk.num_rows``
    done of ``total``; ``walk.seq``/``walk.row_hash``: where it stands).
    """
    with engine.connect() as conn:
        facts = _facts(conn, key)
        marks = _marks(conn, facts) if facts.signed else {}
        start = _start(facts, since, resume)
        walk = Walk(*start, key=key, keyed_from=facts.keyed_from, fingerprints=facts.fingerprints)
        walk.marks = marks
        _walk(conn, walk, facts.last_online, progress)
        at_head = hashes_at(conn, [head.seq]) if head is not None and head.seq else {}
    return _report(facts, walk, start, key, head, at_head)


def _walk(conn: Connection, walk: Walk, last: int, progress: Progress | None) -> None:
    total = max(last - walk.seq, 0)
    for row in rows_after(conn, walk.seq, packed=True):
        walk.take(row)
        if progress is not None and walk.num_rows % 5000 == 0:
            progress(walk, total)
    if progress is not None:
        progress(walk, total)


def _report(facts, walk, start, key, head, at_head) -> VerifyReport:
    reached = [p for p in facts.checkpoints if start[0] <= p.seq <= walk.seq]
    verified = reached[-1] if reached and walk.first_bad is None else None
    problems = list(facts.problems)
    problems.append(_key_problem(key, facts.keyed_from, walk.seq))
    problems.append(_head_problem(head, key, walk.seq, at_head))
    report = VerifyReport(
        num_rows=walk.num_rows,
        num_adapters=len(facts.fingerprints),
        head_seq=walk.seq,
        head_hash=walk.row_hash,
        first_bad=facts.bad_adapter or walk.first_bad,
        keyed_from=facts.keyed_from,
        start_seq=start[0],
        num_checkpoints=len(facts.checkpoints),
        verified_checkpoint=verified,
        newest_checkpoint_at=facts.checkpoints[-1].created_at if facts.checkpoints else None,
        archived_rows=facts.archived_rows,
    )
    found = [p for p in problems if p]
    return replace(report, problem="; ".join(found)) if found else report
