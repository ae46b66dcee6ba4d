"""The usage rollup and the text index.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26

``usage_daily`` (rollup.py) is made and filled from the rows already there: the
writer keeps it from now on. It is derived data, the one table that is not
append-only (the writer adds to its counts).

The text index (text_search.py): on PostgreSQL a trigram GIN index on
``completions.text`` when the ``pg_trgm`` extension is there or this role may
create it (a database owner may: it is a trusted extension; ``audit roles --apply``
creates it as the superuser it runs as); without it, text searches need a time
window. On SQLite an FTS5 table with the trigram tokenizer, kept by an insert
trigger (and filled from the rows already there).
"""

import logging

import sqlalchemy as sa
from alembic import op

from lorapool.audit_db import rollup, text_search

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

log = logging.getLogger(__name__)


def _create_rollup() -> None:
    op.create_table(
        "usage_daily",
        sa.Column("day", sa.Integer, primary_key=True),
        sa.Column("dimension", sa.String(8), primary_key=True),
        sa.Column("group_key", sa.Text, primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False),
        sa.Column("errors", sa.BigInteger, nullable=False),
        sa.Column("latency_hist", sa.JSON().with_variant(sa.Text(), "sqlite"), nullable=False),
    )


def _fill_rollup(bind) -> None:
    rollup.rebuild(bind, progress=False)  # 0005 records how far it goes


def _trgm_schema(bind) -> str | None:
    """The schema of pg_trgm's operator class, creating the extension if allowed."""
    find = sa.text(
        "SELECT n.nspname FROM pg_opclass c JOIN pg_namespace n ON n.oid = c.opcnamespace "
        "WHERE c.opcname = 'gin_trgm_ops'"
    )
    found = bind.execute(find).scalar()
    if found is not None:
        return found
    try:
        with bind.begin_nested():
            for statement in text_search.PG_STATEMENTS:
                bind.execute(sa.text(statement))
    except sa.exc.DBAPIError as exc:
        log.warning("no pg_trgm (%s): text searches will need a time window", exc.orig)
        return None
    return bind.execute(find).scalar()


def _text_index(bind) -> None:
    if bind.dialect.name == "postgresql":
        schema = _trgm_schema(bind)
        if schema is not None:
            op.execute(text_search.pg_index_statement(schema))
        return
    try:
        with bind.begin_nested():
            for statement in text_search.SQLITE_STATEMENTS:
                bind.execute(sa.text(statement))
    except sa.exc.OperationalError as exc:  # an SQLite built without FTS5
        log.warning("no FTS5 (%s): text searches will need a time window", exc.orig)


def upgrade() -> None:
    bind = op.get_bind()
    _create_rollup()
    _fill_rollup(bind)
    _text_index(bind)


def downgrade() -> None:
    raise RuntimeError("0004 cannot be undone in place")
