"""The bulk path of chained rows into ``completions``, past SQLAlchemy's per-row work.

PostgreSQL: one COPY (per row a fraction of a pipelined INSERT on both sides of
the wire). The rows are new by construction: the append path looked their keys
up under the chain lock in the same transaction, and no other writer can add a
row while it holds the lock, so no ``ON CONFLICT`` is needed (nor possible on a
table partitioned by month, see partitions.py). SQLite: one ``executemany`` of
``INSERT ... ON CONFLICT DO NOTHING`` on the driver's cursor. Both bypass
SQLAlchemy's types, so cells are encoded here as the column types would:
text escaped as :class:`ExactText` does, JSON dumped with orjson, token ids
packed (tokens.py). Driver errors are
re-raised as SQLAlchemy's (``IntegrityError``/``DataError`` for a row the
database refuses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from sqlalchemy import Connection, Double, String, bindparam, cast, func
from sqlalchemy.dialects.postgresql import JSON
from sqlalchemy.exc import DBAPIError

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
# trigram GIN among them: ~100 µs a row) while the next is encoded (~14 µs a row)
COPY_CHUNK = 50
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_text(value: str) -> str:
    """``value`` as a field of COPY's text format (backslash, tab, newline, CR escaped)."""
    if "\\" in value or "\t" in value or "\n" in value or "\r" in value:  # C-speed tests
        return value.translate(_COPY_ESCAPES)
    return value


def _copy_encoder(column) -> Callable[[Any], str]:
    """How one column's values are written in COPY's text format (None is ``\\N``)."""
    kind = column.type
    if isinstance(kind, JSONValue):
        return lambda v: _copy_text(orjson.dumps(v).decode())
    if isinstance(kind, exact_text.ExactText):
        return lambda v: _copy_text(exact_text.encode(v))
    if isinstance(kind, tokens.TokenArray):
        return tokens.copy_text
    if isinstance(kind, Double):
        return repr  # the shortest text that reads back as the same double
    if isinstance(kind, String):
        return _copy_text
    return str  # integers


_COLUMNS = [str(c.name) for c in completions.columns]
_COPY_ENCODERS = [(str(c.name), _copy_encoder(c)) for c in completions.columns]
_SQLITE_ENCODERS = [(str(c.name), _encoder(c)) for c in completions.columns]
_COPY = f"COPY completions ({', '.join(_COLUMNS)}) FROM STDIN"
_INSERT = (
    f"INSERT INTO completions ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
    "ON CONFLICT (request_id, completion_index, pool) DO NOTHING"
)


def _copy_lines(rows: list[dict[str, Any]]) -> bytes:
    """The rows as COPY text: a line each, fields tab-separated (one string built per
    row instead of a driver call per field: about a third of the time)."""
    lines = []
    for row in rows:
        fields = []
        for name, encode in _COPY_ENCODERS:
            value = row[name]
            fields.append("\\N" if value is None else encode(value))
        lines.append("\t".join(fields))
    lines.append("")
    return "\n".join(lines).encode()


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


def bulk_insert(conn: Connection, rows: list[dict[str, Any]]) -> int:
    """Insert completion rows (every column) in bulk; returns how many went in."""
    driver = conn.connection.driver_connection
    postgres = conn.dialect.name == "postgresql"
    errors, reraise = _driver_errors(conn, _COPY if postgres else _INSERT)
    try:
        cursor = driver.cursor()
        try:
            if not postgres:
                cursor.executemany(_INSERT, [_cells(row, _SQLITE_ENCODERS) for row in rows])
                return cursor.rowcount
            with cursor.copy(_COPY) as copy:
                for start in range(0, len(rows), COPY_CHUNK):
                    copy.write(_copy_lines(rows[start : start + COPY_CHUNK]))
            return cursor.rowcount
        finally:
            cursor.close()
    except errors as exc:
        reraise(exc)
