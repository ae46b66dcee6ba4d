"""The signed manifest of an archived month, and what verify makes of them.

``audit archive`` moves a month's rows out of the database into a file and
records a :class:`Manifest`: the stretch of the chain it holds (first and last
position, the hash before the first and of the last row), the keyed start, the
file's name, size and sha256, signed with the audit key. It is written next to
the file and kept in the append-only ``archives`` table. The manifests of a
database account, one after the other, for every row from 1 to the row before
the first one still in the table; :func:`online_start` checks that and gives the
(position, hash) the online chain continues from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import orjson
from sqlalchemy import Connection, select

from lorapool import signing
from lorapool.audit_db.chain import GENESIS, canonical
from lorapool.audit_db.schema import archives

ARCHIVE_DOMAIN = "lorapool audit archive v1"
MANIFEST_VERSION = 1


class ArchiveError(RuntimeError):
    """An archive (or its manifest) that cannot be made or trusted; the message says why."""


@dataclass(frozen=True)
class Manifest:
    period: int
    first_seq: int
    last_seq: int
    num_rows: int
    start_hash: str  # the hash of row first_seq - 1 (GENESIS before row 1)
    end_hash: str  # the hash of row last_seq
    keyed_from: int | None
    num_checkpoints: int
    num_adapters: int
    file_name: str
    file_bytes: int
    file_sha256: str
    created_at: float
    v: int = MANIFEST_VERSION
    signature: str = ""

    def signed_fields(self) -> dict:
        fields = asdict(self)
        del fields["signature"]
        return fields

    def expected_signature(self, key: bytes) -> str:
        return signing.mac(key, ARCHIVE_DOMAIN, canonical(self.signed_fields()))

    def signed(self, key: bytes) -> Manifest:
        return Manifest(**self.signed_fields(), signature=self.expected_signature(key))

    def signed_by(self, key: bytes) -> bool:
        return signing.same(self.signature, self.expected_signature(key))

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2) + b"\n"

    @classmethod
    def from_json(cls, raw: bytes | str) -> Manifest:
        try:
            data = orjson.loads(raw)
            if data.get("v") != MANIFEST_VERSION:
                raise ArchiveError(f"unknown manifest version {data.get('v')!r}")
            return cls(**data)
        except (orjson.JSONDecodeError, AttributeError, TypeError) as exc:
            raise ArchiveError(f"not an archive manifest: {exc}") from None


def manifests(conn: Connection) -> list[Manifest]:
    """Every archived month's manifest, oldest first."""
    rows = conn.execute(select(archives.c.manifest).order_by(archives.c.first_seq))
    return [Manifest.from_json(raw) for (raw,) in rows]


def _gap(made: list[Manifest], key: bytes | None) -> str | None:
    """Why these manifests do not account for rows 1 .. their end, one after the other."""
    seq, row_hash = 0, GENESIS
    for manifest in made:
        if key is not None and not manifest.signed_by(key):
            return (
                f"the manifest of archived month {manifest.period} is not signed with the audit key"
            )
        if manifest.first_seq != seq + 1 or manifest.start_hash != row_hash:
            return f"archived month {manifest.period} does not follow the rows before it"
        seq, row_hash = manifest.last_seq, manifest.end_hash
    return None


def online_start(
    conn: Connection, key: bytes | None, first_online: int
) -> tuple[tuple[int, str], int, str | None]:
    """((position, hash) the rows online continue from, rows archived, problem or None)."""
    try:
        made = manifests(conn)
    except ArchiveError as exc:
        return (0, GENESIS), 0, str(exc)
    archived = sum(m.num_rows for m in made)
    problem = _gap(made, key)
    end = (made[-1].last_seq, made[-1].end_hash) if made else (0, GENESIS)
    if problem is None and first_online and first_online != end[0] + 1:
        missing = f"rows {end[0] + 1} to {first_online - 1}"
        problem = f"{missing} are not in the table and no signed archive accounts for them"
    if problem is None and key is None and made:
        problem = "archive manifests are signed: checking them needs the audit key"
    return end, archived, problem
