"""Searching output text: through an index, or only within a time window.

PostgreSQL: a trigram index (``pg_trgm``, GIN) on ``completions.text`` serves
``text LIKE '%needle%'`` (the needle's ``%``, ``_`` and ``\\`` escaped; LIKE is
case-sensitive). SQLite: an FTS5 table with the trigram tokenizer
(``completions_text``, kept by an insert trigger) finds candidate rows by phrase
(case-insensitively), which ``instr`` then narrows to the exact, case-sensitive
matches. Both search the stored (escaped, see exact_text.py) text with the needle
escaped the same way, and both need three characters to use the index.

Where no index can serve a needle (PostgreSQL without ``pg_trgm``, a needle of
fewer than three characters) a search must name a time window of at most
:data:`MAX_SCAN_WINDOW_S`, which the ``arrival_time`` indexes keep small; without
one it is refused (:class:`TextSearchRefused`) rather than reading every row.
"""

from __future__ import annotations

import weakref

from sqlalchemy import Connection, Engine, Integer, Text, func, literal, text

from lorapool.audit_db import exact_text
from lorapool.audit_db.schema import completions

MAX_SCAN_WINDOW_S = 31 * 86_400.0
MIN_INDEXED = 3  # characters a trigram index needs
PG_INDEX = "ix_completions_text_trgm"
SQLITE_FTS = "completions_text"
_HAS_INDEX: weakref.WeakKeyDictionary[Engine, bool] = weakref.WeakKeyDictionary()


class TextSearchRefused(ValueError):
    """A text search that no index can serve and no small time window bounds."""


def has_index(conn: Connection) -> bool:
    """True when this database has a text index (looked up once per engine)."""
    engine = conn.engine
    if engine not in _HAS_INDEX:
        if conn.dialect.name == "postgresql":
            query = (
                "SELECT 1 FROM pg_indexes WHERE schemaname = current_schema() AND indexname = :n"
            )
            found = conn.execute(text(query), {"n": PG_INDEX}).first()
        else:
            query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :n"
            found = conn.execute(text(query), {"n": SQLITE_FTS}).first()
        _HAS_INDEX[engine] = found is not None
    return _HAS_INDEX[engine]


def _check_window(stored: str, since: float | None, until: float | None, indexed: bool) -> None:
    if indexed and len(stored) >= MIN_INDEXED:
        return
    window = None if since is None or until is None else until - since
    if window is not None and window <= MAX_SCAN_WINDOW_S:
        return
    why = "no text index here" if not indexed else f"fewer than {MIN_INDEXED} characters"
    days = MAX_SCAN_WINDOW_S / 86_400
    raise TextSearchRefused(
        f"a text search with {why} must name a time window (since and until) of at most "
        f"{days:.0f} days, so that it does not read every row"
    )


def like_pattern(needle: str) -> str:
    """``%needle%`` with LIKE's wildcards and the escape character escaped (``\\``)."""
    escaped = needle.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def condition(conn: Connection, needle: str, since: float | None, until: float | None):
    """The WHERE condition for "the output text contains ``needle``" (case-sensitive;
    exact unless ``exact_text.needs_recheck(needle)``, then a superset the caller
    narrows). Raises :class:`TextSearchRefused` (see the module docstring)."""
    indexed = has_index(conn)
    stored = exact_text.encode(needle)
    _check_window(stored, since, until, indexed)
    if conn.dialect.name == "postgresql":  # a plain Text literal: already escaped as stored
        return completions.c.text.like(literal(like_pattern(stored), Text()), escape="\\")
    exact = func.instr(completions.c.text, stored) > 0
    if not indexed or len(stored) < MIN_INDEXED:
        return exact
    phrase = '"' + stored.replace('"', '""') + '"'
    query = f"SELECT rowid FROM {SQLITE_FTS} WHERE {SQLITE_FTS} MATCH :phrase"
    candidates = text(query).bindparams(phrase=phrase).columns(rowid=Integer)
    return completions.c.seq.in_(candidates) & exact


PG_STATEMENTS = [
    # pg_trgm is a trusted extension: a database owner may create it; else an
    # administrator does (`audit roles --apply` does, as the superuser it runs as)
    # in public, never in the audit schema: dropping that would take the extension,
    # and every index of another schema that uses it, with it
    "CREATE EXTENSION IF NOT EXISTS pg_trgm WITH SCHEMA public",
]


def pg_index_statement(opclass_schema: str) -> str:
    return (
        f"CREATE INDEX IF NOT EXISTS {PG_INDEX} ON completions "
        f"USING gin (text {opclass_schema}.gin_trgm_ops)"
    )


SQLITE_STATEMENTS = [
    f"CREATE VIRTUAL TABLE {SQLITE_FTS} USING fts5(text, content='completions', "
    "content_rowid='seq', tokenize='trigram')",
    f"CREATE TRIGGER {SQLITE_FTS}_insert AFTER INSERT ON completions BEGIN "
    f"INSERT INTO {SQLITE_FTS} (rowid, text) VALUES (new.seq, new.text); END",
    f"INSERT INTO {SQLITE_FTS} ({SQLITE_FTS}) VALUES ('rebuild')",
]
