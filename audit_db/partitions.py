"""Monthly partitions of ``completions`` on PostgreSQL (declarative, by ``period``).

A row's ``period`` is the month (yyyymm, UTC) the writer wrote it in, never less
than the period of the row before it (:func:`period_of`, taken under the chain
lock), so each month's rows are one unbroken stretch of the chain and a whole
month can be archived and dropped without leaving a hole in the middle.

The writer role has no DDL rights: it asks ``audit_ensure_period(p)``, a
``SECURITY DEFINER`` function the owner's migration makes, for the partition of a
month it is about to write (and the next one). The function makes the partition
as a table of its own and attaches it, which locks ``completions`` only against
other DDL (``SHARE UPDATE EXCLUSIVE``), never against readers or inserts.
SQLite keeps every row in one table (single node, development): ``period`` is
recorded there too, and nothing is partitioned.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import Connection, text

PARTITION_PREFIX = "completions_p"

_ENSURE = """
{verb} FUNCTION audit_ensure_period(p integer) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    part text := 'completions_p' || p;
BEGIN
    IF p < 100001 OR p > 999912 OR p % 100 < 1 OR p % 100 > 12 THEN
        RAISE EXCEPTION 'lorapool audit: % is not a month (yyyymm)', p;
    END IF;
    IF to_regclass(part) IS NOT NULL THEN
        RETURN false;
    END IF;
    EXECUTE format('CREATE TABLE %I (LIKE completions INCLUDING DEFAULTS{including})', part);
    EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I CHECK (period = %s)', part,
                   part || '_period', p);
    EXECUTE format('ALTER TABLE completions ATTACH PARTITION %I FOR VALUES IN (%s)', part, p);
    RETURN true;
END
$$
"""


def ensure_function(replace: bool = False) -> str:
    """``audit_ensure_period`` as revision 0003 made it, or (``replace``) as 0007
    replaces it: its partitions also copy the columns' compression (lz4, 0007)."""
    verb, including = ("CREATE OR REPLACE", " INCLUDING COMPRESSION") if replace else ("CREATE", "")
    return _ENSURE.replace("{verb}", verb).replace("{including}", including)


ENSURE_FUNCTION = ensure_function()


def period_of(timestamp: float) -> int:
    """The month (yyyymm, UTC) of an epoch time."""
    moment = datetime.fromtimestamp(timestamp, timezone.utc)
    return moment.year * 100 + moment.month


def next_period(period: int) -> int:
    year, month = divmod(period, 100)
    return (year + 1) * 100 + 1 if month == 12 else period + 1


def parse_period(value: str) -> int:
    """``2026-03`` or ``202603`` -> 202603; ValueError naming the problem otherwise."""
    digits = value.strip().replace("-", "")
    if not (len(digits) == 6 and digits.isdigit() and 1 <= int(digits[4:]) <= 12):
        raise ValueError(f"{value!r} is not a month (YYYY-MM)")
    return int(digits)


def partitioned(conn: Connection) -> bool:
    return conn.dialect.name == "postgresql"


def ensure(conn: Connection, period: int) -> bool:
    """Make the partition of ``period`` (PostgreSQL; nothing elsewhere); True if made."""
    if not partitioned(conn):
        return False
    return bool(conn.execute(text("SELECT audit_ensure_period(:p)"), {"p": period}).scalar())


def existing(conn: Connection) -> list[int]:
    """The periods that have a partition (PostgreSQL), or rows (SQLite), oldest first."""
    if not partitioned(conn):
        rows = conn.execute(text("SELECT DISTINCT period FROM completions ORDER BY period"))
        return [r[0] for r in rows]
    query = text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'completions'::regclass"
    )
    names = [r[0] for r in conn.execute(query)]
    return sorted(int(n[len(PARTITION_PREFIX) :]) for n in names if n.startswith(PARTITION_PREFIX))


def period_sql(dialect: str, column: str = "written_at") -> str:
    """SQL for the yyyymm (UTC) of an epoch-seconds column."""
    if dialect == "postgresql":
        return f"to_char(to_timestamp({column}) AT TIME ZONE 'UTC', 'YYYYMM')::int"
    return f"CAST(strftime('%Y%m', {column}, 'unixepoch') AS INTEGER)"
