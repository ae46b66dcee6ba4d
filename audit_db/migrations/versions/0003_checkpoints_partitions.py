"""Signed checkpoints, archives, compact rows, monthly partitions, query indexes.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26

``checkpoints`` and ``archives`` are new append-only tables. ``completions`` is
rebuilt (the rows are copied over in chain order, unchanged, so every hash still
verifies) with three new columns: ``chain_version`` (1 for every row already
there), ``prompt_tokens`` and ``output_tokens`` (the compact token ids of version
2 rows) and ``period`` (the month of ``written_at``, never less than the row
before's). The JSON token columns become nullable (version 2 rows leave them
NULL). On PostgreSQL the new table is partitioned by ``period`` (a partition per
month, made by ``audit_ensure_period``, a SECURITY DEFINER function the writer may
call); its primary key is ``(seq, period)`` and ``request_id`` has a plain index
(a unique key across partitions is impossible: the writer keeps it under the
chain lock). The indexes become the ones the queries use: ``(adapter_pk,
arrival_time)``, ``(tenant, arrival_time)``, ``(arrival_time)``. The foreign key
from ``adapter_pk`` to ``adapters`` is gone (a per-row trigger on PostgreSQL's
insert path); ``audit verify`` checks that every referenced adapter exists, and
``adapters`` is append-only. The append-only triggers are made again.
"""

import time

import sqlalchemy as sa
from alembic import op

from lorapool.audit_db.append_only import append_only_statements
from lorapool.audit_db.partitions import ENSURE_FUNCTION, next_period, period_of, period_sql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Json = sa.JSON().with_variant(sa.Text(), "sqlite")
Tokens = sa.LargeBinary().with_variant(sa.ARRAY(sa.Integer()), "postgresql")
OLD = "completions_0002"
TIMES = ("first_scheduled_time", "first_token_time", "last_token_time", "finished_time")
OLD_INDEXES = ("ix_completions_adapter_pk", "ix_completions_tenant", "ix_completions_arrival_time")


def _columns() -> list:
    return [
        sa.Column("seq", BigId, nullable=False),
        sa.Column("request_id", sa.Text, nullable=False),
        sa.Column("completion_index", sa.Integer, nullable=False),
        sa.Column("adapter_pk", BigId),
        sa.Column("base_model_name", sa.Text, nullable=False),
        sa.Column("base_model_sha256", sa.Text, nullable=False),
        sa.Column("prompt", sa.Text),
        sa.Column("prompt_token_ids", Json),
        sa.Column("num_prompt_tokens", sa.Integer, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("token_ids", Json),
        sa.Column("num_output_tokens", sa.Integer, nullable=False),
        sa.Column("finish_reason", sa.String(16), nullable=False),
        sa.Column("stop_reason", Json),
        sa.Column("cumulative_logprob", sa.Double),
        sa.Column("sampling_params", Json, nullable=False),
        sa.Column("request_metadata", Json, nullable=False),
        sa.Column("tenant", sa.Text),
        sa.Column("worker", sa.Text, nullable=False),
        sa.Column("arrival_time", sa.Double, nullable=False),
        *(sa.Column(name, sa.Double) for name in TIMES),
        sa.Column("queue_time", sa.Double),
        sa.Column("error", sa.Text),
        sa.Column("written_at", sa.Double, nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("row_hash", sa.String(64), nullable=False),
        sa.Column("pool", sa.Text),
        sa.Column("chain_version", sa.SmallInteger, nullable=False, server_default="1"),
        sa.Column("prompt_tokens", Tokens),
        sa.Column("output_tokens", Tokens),
        sa.Column("period", sa.Integer, nullable=False),
    ]


NEW_COLUMNS = ("chain_version", "prompt_tokens", "output_tokens", "period")
COPIED = [c.name for c in _columns() if c.name not in NEW_COLUMNS]


def _create_side_tables(dialect: str) -> None:
    op.create_table(
        "checkpoints",
        sa.Column("id", BigId, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("row_hash", sa.String(64), nullable=False),
        sa.Column("num_rows", sa.BigInteger, nullable=False),
        sa.Column("keyed_from", sa.BigInteger),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("prev_signature", sa.String(64), nullable=False),
        sa.Column("signature", sa.String(64), nullable=False),
    )
    op.create_index("ix_checkpoints_seq", "checkpoints", ["seq"])
    op.create_table(
        "archives",
        sa.Column("id", BigId, primary_key=True, autoincrement=False),
        sa.Column("period", sa.Integer, nullable=False),
        sa.Column("first_seq", sa.BigInteger, nullable=False),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column("manifest", sa.Text, nullable=False),
        sa.Column("archived_at", sa.Double, nullable=False),
    )
    for table in ("checkpoints", "archives"):
        for statement in append_only_statements(dialect, table):
            op.execute(statement)


def _set_old_table_aside(dialect: str) -> None:
    """Rename the 0002 table, freeing the names the new one takes (on PostgreSQL index
    and constraint names belong to the schema)."""
    for index in OLD_INDEXES:
        op.execute(f"DROP INDEX {index}")
    if dialect == "postgresql":
        op.execute("ALTER TABLE completions DROP CONSTRAINT uq_completions_pool_request")
        op.execute("ALTER INDEX completions_pkey RENAME TO completions_0002_pkey")
        op.execute("DROP TRIGGER completions_append_only ON completions")
        op.execute("DROP TRIGGER completions_no_truncate ON completions")
    else:
        op.execute("DROP TRIGGER completions_no_update")
        op.execute("DROP TRIGGER completions_no_delete")
    op.rename_table("completions", OLD)


def _create_completions(dialect: str) -> None:
    if dialect == "postgresql":
        op.create_table(
            "completions",
            *_columns(),
            sa.PrimaryKeyConstraint("seq", "period", name="completions_pkey"),
            postgresql_partition_by="LIST (period)",
        )
        op.execute(ENSURE_FUNCTION)
        op.execute("REVOKE ALL ON FUNCTION audit_ensure_period(integer) FROM PUBLIC")
        op.create_index("ix_completions_request", "completions", ["request_id"])
    else:
        columns = _columns()
        columns[0] = sa.Column("seq", BigId, primary_key=True, autoincrement=False)
        op.create_table(
            "completions",
            *columns,
            sa.UniqueConstraint(
                "request_id", "completion_index", "pool", name="uq_completions_pool_request"
            ),
        )


def _periods(bind, dialect: str) -> list[int]:
    """The periods the copied rows take, plus this month and the next."""
    found = bind.execute(sa.text(f"SELECT DISTINCT {period_sql(dialect)} FROM {OLD}"))
    now = period_of(time.time())
    return sorted({r[0] for r in found} | {now, next_period(now)})


def _copy_rows(bind, dialect: str) -> None:
    if dialect == "postgresql":
        for period in _periods(bind, dialect):
            bind.execute(sa.text("SELECT audit_ensure_period(:p)"), {"p": period})
    columns = ", ".join(COPIED)
    # a row's period never goes below the period of a row before it
    period = f"max({period_sql(dialect)}) OVER (ORDER BY seq)"
    op.execute(
        f"INSERT INTO completions ({columns}, chain_version, period) "
        f"SELECT {columns}, 1, {period} FROM {OLD} ORDER BY seq"
    )
    op.drop_table(OLD)


def _finish(dialect: str) -> None:
    op.create_index("ix_completions_adapter_time", "completions", ["adapter_pk", "arrival_time"])
    op.create_index("ix_completions_tenant_time", "completions", ["tenant", "arrival_time"])
    op.create_index("ix_completions_arrival_time", "completions", ["arrival_time"])
    for statement in append_only_statements(dialect, "completions"):
        op.execute(statement)


def upgrade() -> None:
    bind = op.get_bind()
    dialect = bind.dialect.name
    _create_side_tables(dialect)
    _set_old_table_aside(dialect)
    _create_completions(dialect)
    _copy_rows(bind, dialect)
    _finish(dialect)


def downgrade() -> None:
    raise RuntimeError("the audit tables are append-only: 0003 cannot be undone in place")
