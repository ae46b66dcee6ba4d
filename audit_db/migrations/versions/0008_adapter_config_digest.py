"""An adapter is all of its files: ``adapters.config_sha256`` and ``adapters.digest``.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02

The sha256 of the adapter config's math fields and the digest over config and weights
(``lorapool.adapter_config``, issue 48 row D). Nullable: adapters stored before have
neither, and their fingerprint (so every row hash that names them) stays what it was
(``chain.adapter_fingerprint`` counts the new fields only where they are set).
"""

import sqlalchemy as sa
from alembic import op

from lorapool.audit_db.exact_text import ExactText

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("adapters", sa.Column("config_sha256", ExactText(), nullable=True))
    op.add_column("adapters", sa.Column("digest", ExactText(), nullable=True))


def downgrade() -> None:
    raise RuntimeError("0008 cannot be undone in place")
