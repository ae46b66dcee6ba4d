"""Token ids stored compactly: ``int4[]`` on PostgreSQL, packed int32 on SQLite.

Rows of chain version 2 keep their prompt and output token ids here instead of
as JSON text (about 6 bytes an id as text, 4 here). The chain hashes a list as
:func:`packed` bytes: little-endian int32, four bytes an id, the same on every
dialect and machine. Ids outside int32 do not fit; such a row is written as a
version 1 row (JSON), see ``store.prepare``.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import orjson
from sqlalchemy import Integer, LargeBinary
from sqlalchemy.dialects import postgresql
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


def pg_array_text(ids: Sequence[int]) -> str:
    """The text form of an ``int4[]`` (for COPY): ``{1,2,3}`` (orjson writes the digits)."""
    return "{" + orjson.dumps(ids)[1:-1].decode() + "}"


class TokenArray(TypeDecorator):
    """A list of int32 token ids: ``int4[]`` on PostgreSQL, a packed BLOB elsewhere."""

    impl = LargeBinary
    cache_ok = True

    def load_dialect_impl(self, dialect):
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.ARRAY(Integer()))
        return dialect.type_descriptor(LargeBinary())

    def process_bind_param(self, value, dialect):
        if value is None or dialect.name == "postgresql":
            return None if value is None else list(value)
        return packed(value)

    def process_result_value(self, value, dialect):
        if value is None or dialect.name == "postgresql":
            return value
        return unpacked(value)
