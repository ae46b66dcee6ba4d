"""Token ids stored compactly: packed int32 (``bytea`` on PostgreSQL, a BLOB on SQLite).

Rows of chain version 2 keep their prompt and output token ids here instead of
as JSON text (about 6 bytes an id as text, 4 here). The stored bytes are what the
chain hashes (:func:`packed`: little-endian int32, four bytes an id, the same on
every dialect and machine), so a verify reads them without converting anything;
readers get lists. Ids outside int32 do not fit; such a row is written as a
version 1 row (JSON), see ``rows.prepare``. (Revision 0003 stored ``int4[]`` on
PostgreSQL; 0006 converted it: reading an ``int4[]`` of 448 ids cost ~80 µs a row
in psycopg, a bytea ~1 µs, measured in RESULTS.md.)
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

from sqlalchemy import LargeBinary
from sqlalchemy.types import TypeDecorator

_SWAP = sys.byteorder == "big"


def packed(ids: Sequence[int]) -> bytes:
    """Little-endian int32 bytes of ``ids``; ``struct.error`` when one does not fit."""
    return struct.pack(f"<{len(ids)}i", *ids)  # a third of array("i", ids)'s time


def packed_or_none(ids: Sequence[int]) -> bytes | None:
    """:func:`packed`, or None when an id is not an int32."""
    try:
        return packed(ids)
    except struct.error:
        return None


def fits(ids: Sequence[int]) -> bool:
    """True when every id is an int32 (an empty list fits)."""
    return packed_or_none(ids) is not None


def unpacked(data: bytes) -> list[int]:
    """The ids :func:`packed` made ``data`` from."""
    values = array("i")
    values.frombytes(data)
    if _SWAP:
        values.byteswap()
    return values.tolist()


def as_packed(ids: Sequence[int] | bytes) -> bytes:
    """Packed bytes of a list of ids (bytes already packed pass through)."""
    return ids if isinstance(ids, bytes) else packed(ids)


class TokenArray(TypeDecorator):
    """A list of int32 token ids, stored packed (``bytea`` / BLOB); binds lists or
    packed bytes, reads back lists."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return None if value is None else as_packed(value)

    def process_result_value(self, value, dialect):
        return None if value is None else unpacked(bytes(value))
