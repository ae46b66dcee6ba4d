"""The audit tables (SQLAlchemy Core), the single source the migrations mirror.

``adapters``: one row per adapter version, keyed by ``fingerprint`` (sha256 of
its identity fields). ``completions``: one row per CompletionOutput, in hash
chain order: ``seq`` is the chain position (1, 2, ...), ``row_hash`` =
sha256(prev_hash, canonical row). Both tables are append-only.
"""

from typing import Any

import orjson
from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import TypeDecorator

# INTEGER PRIMARY KEY is SQLite's rowid alias; BIGINT elsewhere.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class JSONValue(TypeDecorator):
    """JSON: native ``json`` on PostgreSQL, TEXT elsewhere.

    SQLite's ``JSON`` column type has NUMERIC affinity, which would turn a
    stored ``"1.0"`` into the integer 1; TEXT keeps the bytes as written.
    """

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect):
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.JSON(none_as_null=True))
        return dialect.type_descriptor(Text())

    def process_bind_param(self, value: Any, dialect):
        if value is None or dialect.name == "postgresql":
            return value
        return orjson.dumps(value).decode()

    def process_result_value(self, value: Any, dialect):
        if value is None or dialect.name == "postgresql":
            return value
        return orjson.loads(value)


metadata = MetaData()

adapters = Table(
    "adapters",
    metadata,
    Column("pk", BigId, primary_key=True, autoincrement=True),
    Column("fingerprint", String(64), nullable=False, unique=True),
    Column("name", String, nullable=False),
    Column("adapter_id", Integer, nullable=False),
    Column("path", String, nullable=False),
    Column("sha256", String, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("alpha", Double, nullable=False),
    Column("target_modules", JSONValue(), nullable=False),
    Column("base_model", String, nullable=True),
    Column("first_seen", Double, nullable=False),
    Index("ix_adapters_name", "name"),
    Index("ix_adapters_sha256", "sha256"),
    Index("ix_adapters_adapter_id", "adapter_id"),
)

completions = Table(
    "completions",
    metadata,
    Column("seq", BigId, primary_key=True, autoincrement=False),
    Column("request_id", String, nullable=False),
    Column("completion_index", Integer, nullable=False),
    Column("adapter_pk", BigId, ForeignKey("adapters.pk"), nullable=True),
    Column("base_model_name", String, nullable=False),
    Column("base_model_sha256", String, nullable=False),
    Column("prompt", Text, nullable=True),
    Column("prompt_token_ids", JSONValue(), nullable=False),
    Column("num_prompt_tokens", Integer, nullable=False),
    Column("text", Text, nullable=False),
    Column("token_ids", JSONValue(), nullable=False),
    Column("num_output_tokens", Integer, nullable=False),
    Column("finish_reason", String(16), nullable=False),
    Column("stop_reason", JSONValue(), nullable=True),
    Column("cumulative_logprob", Double, nullable=True),
    Column("sampling_params", JSONValue(), nullable=False),
    Column("request_metadata", JSONValue(), nullable=False),
    Column("tenant", String, nullable=True),
    Column("worker", String, nullable=False),
    Column("arrival_time", Double, nullable=False),
    Column("first_scheduled_time", Double, nullable=True),
    Column("first_token_time", Double, nullable=True),
    Column("last_token_time", Double, nullable=True),
    Column("finished_time", Double, nullable=True),
    Column("queue_time", Double, nullable=True),
    Column("error", Text, nullable=True),
    Column("written_at", Double, nullable=False),
    Column("prev_hash", String(64), nullable=False),
    Column("row_hash", String(64), nullable=False),
    UniqueConstraint("request_id", "completion_index", name="uq_completions_request"),
    Index("ix_completions_adapter_pk", "adapter_pk"),
    Index("ix_completions_tenant", "tenant"),
    Index("ix_completions_arrival_time", "arrival_time"),
)

# Columns covered by a completion's row hash, in a fixed order (the adapter
# enters through its fingerprint, see chain.py).
_UNHASHED = ("adapter_pk", "prev_hash", "row_hash")
HASHED_COLUMNS = tuple(str(c.name) for c in completions.columns if c.name not in _UNHASHED)
ADAPTER_IDENTITY = (
    "name",
    "adapter_id",
    "path",
    "sha256",
    "rank",
    "alpha",
    "target_modules",
    "base_model",
)
