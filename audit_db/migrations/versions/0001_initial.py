"""Initial audit tables: adapters, completions, append-only triggers.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

import sqlalchemy as sa
from alembic import op

from lorapool.audit_db.append_only import REJECT_FUNCTION, append_only_statements

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
# SQLite's JSON type has NUMERIC affinity (a stored "1.0" would come back as 1).
Json = sa.JSON().with_variant(sa.Text(), "sqlite")
TABLES = ("adapters", "completions")
# A column is nullable unless it says nullable=False (SQLAlchemy's default, as in SQL DDL).


def _create_adapters() -> None:
    op.create_table(
        "adapters",
        sa.Column("pk", BigId, primary_key=True, autoincrement=True),
        sa.Column("fingerprint", sa.String(64), nullable=False, unique=True),
        sa.Column("name", sa.String, nullable=False),
        sa.Column("adapter_id", sa.Integer, nullable=False),
        sa.Column("path", sa.String, nullable=False),
        sa.Column("sha256", sa.String, nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("alpha", sa.Double, nullable=False),
        sa.Column("target_modules", Json, nullable=False),
        sa.Column("base_model", sa.String),
        sa.Column("first_seen", sa.Double, nullable=False),
    )
    op.create_index("ix_adapters_name", "adapters", ["name"])
    op.create_index("ix_adapters_sha256", "adapters", ["sha256"])
    op.create_index("ix_adapters_adapter_id", "adapters", ["adapter_id"])


def _completion_columns() -> list:
    times = (
        "first_scheduled_time",
        "first_token_time",
        "last_token_time",
        "finished_time",
        "queue_time",
    )
    return [
        sa.Column("seq", BigId, primary_key=True, autoincrement=False),
        sa.Column("request_id", sa.String, nullable=False),
        sa.Column("completion_index", sa.Integer, nullable=False),
        sa.Column("adapter_pk", BigId, sa.ForeignKey("adapters.pk")),
        sa.Column("base_model_name", sa.String, nullable=False),
        sa.Column("base_model_sha256", sa.String, nullable=False),
        sa.Column("prompt", sa.Text),
        sa.Column("prompt_token_ids", Json, nullable=False),
        sa.Column("num_prompt_tokens", sa.Integer, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("token_ids", Json, nullable=False),
        sa.Column("num_output_tokens", sa.Integer, nullable=False),
        sa.Column("finish_reason", sa.String(16), nullable=False),
        sa.Column("stop_reason", Json),
        sa.Column("cumulative_logprob", sa.Double),
        sa.Column("sampling_params", Json, nullable=False),
        sa.Column("request_metadata", Json, nullable=False),
        sa.Column("tenant", sa.String),
        sa.Column("worker", sa.String, nullable=False),
        sa.Column("arrival_time", sa.Double, nullable=False),
        *(sa.Column(name, sa.Double) for name in times),
        sa.Column("error", sa.Text),
        sa.Column("written_at", sa.Double, nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("row_hash", sa.String(64), nullable=False),
        sa.UniqueConstraint("request_id", "completion_index", name="uq_completions_request"),
    ]


def _create_completions() -> None:
    op.create_table("completions", *_completion_columns())
    op.create_index("ix_completions_adapter_pk", "completions", ["adapter_pk"])
    op.create_index("ix_completions_tenant", "completions", ["tenant"])
    op.create_index("ix_completions_arrival_time", "completions", ["arrival_time"])


def _create_triggers(dialect: str) -> None:
    if dialect not in ("postgresql", "sqlite"):
        return
    if dialect == "postgresql":
        op.execute(REJECT_FUNCTION)
    for table in TABLES:
        for statement in append_only_statements(dialect, table):
            op.execute(statement)


def upgrade() -> None:
    _create_adapters()
    _create_completions()
    _create_triggers(op.get_bind().dialect.name)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.drop_table("completions")
    op.drop_table("adapters")
    if dialect == "postgresql":
        op.execute("DROP FUNCTION audit_reject_change()")
