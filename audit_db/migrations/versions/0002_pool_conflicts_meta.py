"""The pool in the completions key; conflicts and audit_meta tables.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25

``completions`` gains ``pool`` (NULL on the rows already there, whose hashes
leave it out) and ``(pool, request_id, completion_index)`` becomes its unique
key, so one request id in two pools gives two rows. ``conflicts`` keeps a
record that disagreed with the stored row for its key; ``audit_meta`` holds
facts about the chain (from which row it is keyed). Both are append-only.
Text columns now hold an escaped form (see ``audit_db/exact_text.py``); the
upgrade refuses to run when an existing row holds one of the two escape
characters, which would then read back differently.
"""

import sqlalchemy as sa
from alembic import op

from lorapool.audit_db.append_only import append_only_statements

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Json = sa.JSON().with_variant(sa.Text(), "sqlite")
ESCAPES = ("\ufdd0", "\ufdd1")
TEXT_COLUMNS = {
    "adapters": ("name", "path", "sha256", "base_model"),
    "completions": (
        "request_id",
        "base_model_name",
        "base_model_sha256",
        "prompt",
        "text",
        "tenant",
        "worker",
        "error",
    ),
}


def _refuse_escape_characters(bind) -> None:
    find = "strpos" if bind.dialect.name == "postgresql" else "instr"
    for table, columns in TEXT_COLUMNS.items():
        for column in columns:
            for char in ESCAPES:
                found = bind.execute(
                    sa.text(f"SELECT count(*) FROM {table} WHERE {find}({column}, :c) > 0"),
                    {"c": char},
                ).scalar()
                if found:
                    raise RuntimeError(
                        f"{found} rows of {table}.{column} hold U+{ord(char):04X}, which the "
                        "new text escaping reserves; they would read back changed. Export "
                        "them before upgrading."
                    )


def _append_only(dialect: str, table: str) -> None:
    for statement in append_only_statements(dialect, table):
        op.execute(statement)


def _pool_in_key(dialect: str) -> None:
    # SQLite cannot drop a constraint: batch mode copies the table (which drops
    # its triggers, so they are made again).
    with op.batch_alter_table("completions", recreate="auto") as batch:
        batch.add_column(sa.Column("pool", sa.Text, nullable=True))
        batch.drop_constraint("uq_completions_request", type_="unique")
        batch.create_unique_constraint(
            "uq_completions_pool_request", ["request_id", "completion_index", "pool"]
        )
    if dialect == "sqlite":
        _append_only(dialect, "completions")


def _create_conflicts() -> None:
    op.create_table(
        "conflicts",
        sa.Column("pk", BigId, primary_key=True, autoincrement=True),
        sa.Column("pool", sa.Text, nullable=False),
        sa.Column("request_id", sa.Text, nullable=False),
        sa.Column("completion_index", sa.Integer, nullable=False),
        sa.Column("stored_digest", sa.String(64), nullable=False),
        sa.Column("refused_digest", sa.String(64), nullable=False),
        sa.Column("refused_row", Json, nullable=False),
        sa.Column("source", sa.Text, nullable=True),
        sa.Column("detected_at", sa.Double, nullable=False),
    )
    op.create_index("ix_conflicts_request", "conflicts", ["pool", "request_id"])


def upgrade() -> None:
    bind = op.get_bind()
    dialect = bind.dialect.name
    _refuse_escape_characters(bind)
    _pool_in_key(dialect)
    _create_conflicts()
    op.create_table(
        "audit_meta",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.String, nullable=False),
    )
    for table in ("conflicts", "audit_meta"):
        _append_only(dialect, table)


def downgrade() -> None:
    raise RuntimeError("the audit tables are append-only: 0002 cannot be undone in place")
