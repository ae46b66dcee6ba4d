"""The rollup's progress: ``usage_progress``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26

The writer now refreshes the usage rollup every few thousand rows (and when idle)
instead of in every batch's transaction, and records here the last chain position
the rollup covers; usage adds the rows after it. Under 0004 the rollup was kept in
every batch's transaction, so it covers every row there is.
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_progress",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("seq", sa.BigInteger, nullable=False),
    )
    op.execute(
        "INSERT INTO usage_progress (name, seq) "
        "SELECT 'rolled', coalesce(max(seq), 0) FROM completions"
    )


def downgrade() -> None:
    raise RuntimeError("0005 cannot be undone in place")
