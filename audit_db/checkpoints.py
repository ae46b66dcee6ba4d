"""Signed checkpoints of the hash chain: (position, hash, row count, time), every K
rows and at least daily, in the append-only ``checkpoints`` table.

A checkpoint says "at ``created_at`` the chain held ``num_rows`` rows and the row
at ``seq`` had ``row_hash``; rows from ``keyed_from`` on are keyed". It is signed
with the audit key (HMAC-SHA256) and links to the checkpoint before it through
``prev_signature``, so nobody without the key can make one, change one, drop one
from the middle or move the start of the keyed rows (a key downgrade). Checkpoint
``id`` runs 1, 2, ... with no gap. A chain with keyed rows always has one: the
writer makes the first in the transaction of the first keyed rows.

:func:`export` also writes each one to a folder as a JSON file (made once, never
overwritten: point it at write-once storage); ``audit verify --head FILE``
accepts such a file.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Connection, func, select

from lorapool import signing
from lorapool.audit_db.chain import GENESIS, canonical
from lorapool.audit_db.schema import checkpoints

CHECKPOINT_DOMAIN = "lorapool audit checkpoint v1"
FILE_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint (or checkpoint file) that cannot be trusted; the message says why."""


@dataclass(frozen=True)
class Checkpoint:
    id: int
    seq: int
    row_hash: str
    num_rows: int
    keyed_from: int | None
    created_at: float
    prev_signature: str
    signature: str = ""

    def signed_fields(self) -> dict[str, Any]:
        fields = asdict(self)
        del fields["signature"]
        return fields

    def expected_signature(self, key: bytes) -> str:
        return signing.mac(key, CHECKPOINT_DOMAIN, canonical(self.signed_fields()))

    def signed(self, key: bytes) -> Checkpoint:
        return Checkpoint(**self.signed_fields(), signature=self.expected_signature(key))

    def problem(self, key: bytes, before: Checkpoint | None) -> str | None:
        """Why this checkpoint cannot be trusted after ``before`` (None: it can)."""
        if not signed_by(self, key):
            return f"checkpoint {self.id} is not signed with the audit key"
        prev_id, prev_signature = (before.id, before.signature) if before else (0, GENESIS)
        if self.id != prev_id + 1:
            return f"checkpoint {prev_id + 1} is missing (the next one is {self.id})"
        if self.prev_signature != prev_signature:
            return f"checkpoint {self.id} does not link to checkpoint {prev_id}"
        if self.num_rows != self.seq:
            return f"checkpoint {self.id} counts {self.num_rows} rows at position {self.seq}"
        if before is not None and (self.seq < before.seq or self.keyed_from != before.keyed_from):
            return f"checkpoint {self.id} goes back or moves the keyed start"
        return None

    def to_json(self) -> bytes:
        return orjson.dumps(
            {"v": FILE_VERSION, "checkpoint": asdict(self)}, option=orjson.OPT_INDENT_2
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> Checkpoint:
        try:
            data = orjson.loads(raw)
            if data.get("v") != FILE_VERSION or "checkpoint" not in data:
                raise CheckpointError("not a checkpoint file")
            return cls(**data["checkpoint"])
        except (orjson.JSONDecodeError, AttributeError, TypeError) as exc:
            raise CheckpointError(f"not a checkpoint file: {exc}") from None


def signed_by(checkpoint: Checkpoint, key: bytes) -> bool:
    """True when ``checkpoint``'s signature is the audit key's."""
    return signing.same(checkpoint.signature, checkpoint.expected_signature(key))


def _from_row(row) -> Checkpoint:
    return Checkpoint(**{k: row[k] for k in Checkpoint.__dataclass_fields__})


def latest(conn: Connection) -> Checkpoint | None:
    """The newest checkpoint (None: there is none)."""
    row = conn.execute(select(checkpoints).order_by(checkpoints.c.id.desc()).limit(1))
    found = row.mappings().first()
    return _from_row(found) if found else None


def every(conn: Connection) -> list[Checkpoint]:
    """Every checkpoint, oldest first (a few thousand at 100M rows)."""
    rows = conn.execute(select(checkpoints).order_by(checkpoints.c.id)).mappings()
    return [_from_row(row) for row in rows]


def by_id(conn: Connection, checkpoint_id: int) -> Checkpoint | None:
    row = conn.execute(select(checkpoints).where(checkpoints.c.id == checkpoint_id))
    found = row.mappings().first()
    return _from_row(found) if found else None


def count(conn: Connection) -> int:
    return conn.execute(select(func.count()).select_from(checkpoints)).scalar()


def make(
    before: Checkpoint | None,
    seq: int,
    row_hash: str,
    keyed_from: int | None,
    now: float,
    key: bytes,
) -> Checkpoint:
    """The next checkpoint after ``before``, signed."""
    draft = Checkpoint(
        id=before.id + 1 if before else 1,
        seq=seq,
        row_hash=row_hash,
        num_rows=seq,
        keyed_from=keyed_from,
        created_at=now,
        prev_signature=before.signature if before else GENESIS,
    )
    return draft.signed(key)


def insert(conn: Connection, checkpoint: Checkpoint) -> None:
    conn.execute(checkpoints.insert(), asdict(checkpoint))


def export(checkpoint: Checkpoint, folder: str | Path) -> Path:
    """Write ``checkpoint`` to ``folder/checkpoint-<id>.json``, never overwriting a
    file there (an existing one with the same content is left as it is)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"checkpoint-{checkpoint.id:012d}.json"
    data = checkpoint.to_json() + b"\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if path.read_bytes() != data:
            raise CheckpointError(f"{path} exists and holds another checkpoint") from None
        return path
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return path
