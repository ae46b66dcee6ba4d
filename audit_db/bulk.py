"""The bulk path of chained rows into ``completions``, past SQLAlchemy's per-row work.

PostgreSQL: one COPY in the binary format (per row a fraction of a pipelined
INSERT on both sides of the wire; the binary format spares the server parsing
text: benchmarks/RESULTS.md, helper 71). The rows are new by construction: the
append path looked their keys up under the chain lock in the same transaction,
and no other writer can add a row while it holds the lock, so no ``ON CONFLICT``
is needed (nor possible on a table partitioned by month, see partitions.py).
SQLite: one ``executemany`` of ``INSERT ... ON CONFLICT DO NOTHING`` on the
driver's cursor. Both bypass SQLAlchemy's types, so cells are encoded here as
the column types would: text escaped as :class:`ExactText` does, JSON dumped
with orjson, token ids packed (tokens.py). Driver errors are re-raised as
SQLAlchemy's (``IntegrityError``/``DataError`` for a row the database refuses;
a value its column's binary form cannot hold is a ``DataError`` too, before the
server sees it).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import orjson
from psycopg import errors as pg_errors
from psycopg import generators, pq
from psycopg.copy import LibpqWriter
from psycopg.waiting import Wait
from sqlalchemy import (
    BigInteger,
    Connection,
    Double,
    Integer,
    SmallInteger,
    String,
    bindparam,
    cast,
    func,
)
from sqlalchemy.dialects.postgresql import JSON
from sqlalchemy.exc import DataError, DBAPIError

from lorapool.audit_db import exact_text, tokens
from lorapool.audit_db.schema import JSONValue, completions


def wanted_rows(rows: list[dict[str, Any]], *columns):
    """PostgreSQL: ``rows`` as a derived table ``wanted`` of ``columns`` (SQLAlchemy
    ``column``s), sent as one JSON parameter (``json_to_recordset``): the keys a batch
    looks up (the writer's stored keys, the rollup's cells), where one array parameter
    a column cost psycopg a Python call an element."""
    keys = cast(bindparam("keys", orjson.dumps(rows).decode()), JSON)
    return (
        func.json_to_recordset(keys)
        .table_valued(*columns)
        .render_derived("wanted", with_types=True)
    )


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def _encoder(column) -> Callable[[Any], Any] | None:
    if isinstance(column.type, JSONValue):
        return _json
    if isinstance(column.type, exact_text.ExactText):
        return exact_text.encode
    if isinstance(column.type, tokens.TokenArray):
        return tokens.as_packed
    return None


# rows encoded and sent at a time: the server inserts one chunk (its indexes, the
# trigram GIN among them: ~100 µs a row) while the next is encoded
COPY_CHUNK = 50
# COPY's binary format (PostgreSQL docs, "COPY", "Binary Format"): a signature, flags
# and header extension length, then per row the field count and each field as its
# length (-1 for NULL) and bytes in the column type's binary form; -1 ends the data
_SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + bytes(8)
_TRAILER = b"\xff\xff"
_NULL = b"\xff\xff\xff\xff"
_LENGTH = struct.Struct(">i").pack
_INT8, _INT4 = struct.Struct(">iq").pack, struct.Struct(">ii").pack  # length and value
_INT2, _FLOAT8 = struct.Struct(">ih").pack, struct.Struct(">id").pack


def _binary_text(value: str) -> bytes:
    data = value.encode()
    return _LENGTH(len(data)) + data


def _binary_bytes(data: bytes) -> bytes:
    return _LENGTH(len(data)) + data


def _binary_json(value: Any) -> bytes:
    return _binary_bytes(orjson.dumps(value))  # json's binary input is its text


class Unencodable(ValueError):
    """A value its column's type cannot hold (an integer out of range, say): the
    database would refuse the row; raised to the writer as a ``DataError``."""


def _fixed(pack, size: int, column: str, kind: str) -> Callable[[Any], bytes]:
    def encode(value: Any) -> bytes:
        try:
            return pack(size, value)
        except (struct.error, OverflowError, TypeError) as exc:
            raise Unencodable(f"column {column}: {value!r} is not a valid {kind} ({exc})") from None

    return encode


def _binary_encoder(column) -> Callable[[Any], bytes]:
    """How one column's (non-NULL) values are written in COPY's binary format: what the
    server's receive function of the column's type reads."""
    kind, name = column.type, str(column.name)
    if isinstance(kind, JSONValue):
        return _binary_json
    if isinstance(kind, exact_text.ExactText):
        return lambda v: _binary_text(exact_text.encode(v))
    if isinstance(kind, tokens.TokenArray):
        return lambda v: _binary_bytes(tokens.as_packed(v))
    if isinstance(kind, Double):
        return _fixed(_FLOAT8, 8, name, "double precision")
    if isinstance(kind, String):
        return _binary_text
    if isinstance(kind, BigInteger):
        return _fixed(_INT8, 8, name, "bigint")
    if isinstance(kind, SmallInteger):
        return _fixed(_INT2, 2, name, "smallint")
    if isinstance(kind, Integer):
        return _fixed(_INT4, 4, name, "integer")
    raise TypeError(f"no binary COPY encoding for column {name} ({kind!r})")


_COLUMNS = [str(c.name) for c in completions.columns]
_BINARY_ENCODERS = [(str(c.name), _binary_encoder(c)) for c in completions.columns]
_SQLITE_ENCODERS = [(str(c.name), _encoder(c)) for c in completions.columns]
_COPY = f"COPY completions ({', '.join(_COLUMNS)}) FROM STDIN (FORMAT BINARY)"
_FIELDS = struct.pack(">h", len(_COLUMNS))
_INSERT = (
    f"INSERT INTO completions ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
    "ON CONFLICT (request_id, completion_index, pool) DO NOTHING"
)


def _copy_binary(rows: list[dict[str, Any]]) -> bytes:
    """The rows in COPY's binary format, without signature or trailer. Nothing to
    escape or to print, and the server parses no text: no hex of the packed token
    ids (1.8 kB a bench row), no digits of the seven doubles."""
    parts = []
    for row in rows:
        parts.append(_FIELDS)
        for name, encode in _BINARY_ENCODERS:
            value = row[name]
            parts.append(_NULL if value is None else encode(value))
    return b"".join(parts)


def encode(rows: list[dict[str, Any]]) -> list[bytes]:
    """The rows as the COPY chunks :func:`bulk_insert` sends (PostgreSQL); raises
    :class:`Unencodable` for a value its column cannot hold."""
    return [_copy_binary(rows[i : i + COPY_CHUNK]) for i in range(0, len(rows), COPY_CHUNK)]


def _cells(row: dict[str, Any], encoders) -> list[Any]:
    cells = []
    for name, encode in encoders:
        value = row[name]
        cells.append(value if value is None or encode is None else encode(value))
    return cells


def _driver_errors(conn: Connection, sql: str):
    """Driver errors as SQLAlchemy's (so the writer tells "refused" from "away")."""
    dbapi = conn.dialect.loaded_dbapi

    def reraise(exc):
        raise DBAPIError.instance(sql, None, exc, dbapi.Error, dialect=conn.dialect) from exc

    return dbapi.Error, reraise


class _WorkWhileInserting(LibpqWriter):
    """Ends the COPY, runs ``meanwhile`` until it returns False, then reads the server's
    answer. A binary COPY of fewer than 1,000 rows is inserted only at its end (the
    server buffers rows for a multi-insert until 1,000 or 64 kB of *text* lines, and a
    binary row counts no bytes): the writer waited ~100 µs a row there, idle, the
    server busy (RESULTS.md, session 6). The steps are psycopg's own (3.3) of
    ``LibpqWriter.finish`` and ``psycopg.generators.copy_end``, split in two; the
    connection waits as psycopg's do, so a stall or a dropped server raises as there."""

    def __init__(self, cursor, meanwhile: Callable[[], bool]):
        super().__init__(cursor)
        self._meanwhile = meanwhile

    def finish(self, exc: BaseException | None = None) -> None:
        if exc is not None:  # the COPY is cancelled: nothing to overlap
            super().finish(exc)
            return
        self.connection.wait(_send_copy_end(self._pgconn))
        try:
            while self._meanwhile():
                pass
        finally:  # the answer is read whatever happened, or the connection stays busy
            (result,) = self.connection.wait(generators.fetch_many(self._pgconn))
        if result.status != pq.ExecStatus.COMMAND_OK:
            raise pg_errors.error_from_result(result, encoding=self._pgconn._encoding)
        self.cursor._results = [result]


def _send_copy_end(pgconn):
    """Send CopyDone and flush it, without waiting for the result (psycopg's
    ``copy_end`` up to its fetch)."""
    while pgconn.put_copy_end(None) == 0:
        while not (yield Wait.W):
            continue
    while True:
        while not (yield Wait.W):
            continue
        if pgconn.flush() == 0:
            return


def bulk_insert(
    conn: Connection,
    rows: list[dict[str, Any]],
    meanwhile: Callable[[], bool] | None = None,
    encoded: list[bytes] | None = None,
) -> int:
    """Insert completion rows (every column) in bulk; returns how many went in.
    ``encoded``: the rows' COPY chunks already made by :func:`encode` (PostgreSQL).

    ``meanwhile`` (PostgreSQL): the caller's work, run a slice a call (until it returns
    False) once every row is sent, while the server inserts them (the writer parses its
    next batch there); the COPY's result is read after it."""
    driver = conn.connection.driver_connection
    postgres = conn.dialect.name == "postgresql"
    errors, reraise = _driver_errors(conn, _COPY if postgres else _INSERT)
    try:
        cursor = driver.cursor()
        try:
            if not postgres:
                cursor.executemany(_INSERT, [_cells(row, _SQLITE_ENCODERS) for row in rows])
                return cursor.rowcount
            writer = None if meanwhile is None else _WorkWhileInserting(cursor, meanwhile)
            with cursor.copy(_COPY, writer=writer) as copy:
                copy.write(_SIGNATURE)
                for chunk in encode(rows) if encoded is None else encoded:
                    copy.write(chunk)
                copy.write(_TRAILER)
            return cursor.rowcount
        finally:
            cursor.close()
    except errors as exc:
        reraise(exc)
    except Unencodable as exc:  # refused before the server saw it, as it would refuse it
        raise DataError(_COPY, None, exc) from exc
