"""PostgreSQL bulk path: COPY into a staging table, then INSERT ... ON CONFLICT.

Per row, COPY costs a fraction of a pipelined INSERT on both sides of the wire;
the final ``INSERT ... SELECT ... ON CONFLICT DO NOTHING`` keeps the same
idempotency as the generic path. The staging table is a temporary table that
lives for one transaction (``ON COMMIT DROP``), so it always matches the
current ``completions`` columns. COPY bypasses SQLAlchemy's types, so text
columns are escaped here as :class:`ExactText` does. Driver errors are re-raised as SQLAlchemy's
(``DataError`` for a value PostgreSQL cannot store).
"""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from lorapool.audit_db import exact_text
from lorapool.audit_db.schema import JSONValue, completions

STAGING = "audit_completions_staging"
_COLUMNS = [str(c.name) for c in completions.columns]
_JSON_COLUMNS = {str(c.name) for c in completions.columns if isinstance(c.type, JSONValue)}
_TEXT_COLUMNS = {
    str(c.name) for c in completions.columns if isinstance(c.type, exact_text.ExactText)
}
_COLUMN_LIST = ", ".join(_COLUMNS)


def _cell(column: str, value: Any) -> Any:
    if value is None:
        return None
    if column in _JSON_COLUMNS:
        return orjson.dumps(value).decode()
    if column in _TEXT_COLUMNS:
        return exact_text.encode(value)
    return value


def _copy(conn: Connection, rows: list[dict[str, Any]]) -> None:
    driver = conn.connection.driver_connection
    sql = f"COPY {STAGING} ({_COLUMN_LIST}) FROM STDIN"
    try:
        with driver.cursor() as cursor, cursor.copy(sql) as copy:
            for row in rows:
                copy.write_row([_cell(c, row[c]) for c in _COLUMNS])
    except conn.dialect.loaded_dbapi.Error as exc:
        raise DBAPIError.instance(
            sql, None, exc, conn.dialect.loaded_dbapi.Error, dialect=conn.dialect
        ) from exc


def copy_insert(conn: Connection, rows: list[dict[str, Any]]) -> int:
    """Insert completion rows (all columns) in bulk; returns how many went in."""
    conn.exec_driver_sql(
        f"CREATE TEMPORARY TABLE {STAGING} (LIKE completions INCLUDING DEFAULTS) ON COMMIT DROP"
    )
    _copy(conn, rows)
    result = conn.exec_driver_sql(
        f"INSERT INTO completions ({_COLUMN_LIST}) SELECT {_COLUMN_LIST} FROM {STAGING} "
        "ON CONFLICT (pool, request_id, completion_index) DO NOTHING"
    )
    return result.rowcount
