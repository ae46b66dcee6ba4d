"""Long completion columns compressed with lz4 on PostgreSQL.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26

A bench row (~600-character prompt and output, 256 + 192 packed token ids) is past
PostgreSQL's 2 kB TOAST threshold, so every insert compressed its long columns with
pglz: the writer's COPY spent 43 µs of the server's CPU a row without the trigram
index, 32 with lz4 (RESULTS.md, issue 34, helper 61). New values only: stored rows
keep their pglz bytes (a value reads back the same either way, so hashes and
verify do not change). Partitions made from now on copy the columns' compression
(``audit_ensure_period`` makes them ``LIKE completions INCLUDING COMPRESSION``).
Skipped where the server was built without lz4 (it then keeps pglz).
"""

from alembic import op
from sqlalchemy import text

from lorapool.audit_db.partitions import ensure_function

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

LONG_COLUMNS = ("prompt", "text", "prompt_tokens", "output_tokens", "prompt_token_ids",
                "token_ids", "sampling_params", "request_metadata", "stop_reason",
                "error")  # fmt: skip
HAS_LZ4 = "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"

PARTITIONS = (
    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
    "WHERE i.inhparent = 'completions'::regclass"
)


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql" or not bind.execute(text(HAS_LZ4)).scalar():
        return
    changes = ", ".join(f"ALTER COLUMN {c} SET COMPRESSION lz4" for c in LONG_COLUMNS)
    parts = bind.execute(text(PARTITIONS)).scalars().all()
    quote = bind.dialect.identifier_preparer.quote
    for table in ["completions", *parts]:  # it does not recurse into partitions
        op.execute(f"ALTER TABLE {quote(table)} {changes}")
    op.execute(ensure_function(replace=True))


def downgrade() -> None:
    raise RuntimeError("0007 cannot be undone in place")
