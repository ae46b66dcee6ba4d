"""The audit tables (SQLAlchemy Core), the single source the migrations mirror.

``adapters``: one row per adapter version, keyed by ``fingerprint`` (sha256 of
its identity fields). ``completions``: one row per CompletionOutput, in hash
chain order: ``seq`` is the chain position (1, 2, ...), ``row_hash`` chains it
to the row before (see chain.py); ``(pool, request_id, completion_index)`` is
unique (``pool`` is the Redis prefix; NULL on rows written before it was
recorded). Rows of ``chain_version`` 2 keep their token ids in ``prompt_tokens``
and ``output_tokens`` (tokens.py), version 1 rows as JSON in
``prompt_token_ids`` and ``token_ids``. ``period`` (yyyymm, never decreasing
along the chain) is the month a row belongs to: on PostgreSQL ``completions``
is partitioned by it (one partition a month, see partitions.py), its primary key
is ``(seq, period)`` and the writer keeps the key unique under the chain lock
(PostgreSQL cannot index a key across partitions). ``checkpoints``: signed
(position, hash, count, time) of the chain (checkpoints.py). ``archives``: the
signed manifests of months moved out to archive files (archive.py).
``conflicts``: a record that disagreed with the row already stored for its key,
kept instead of being dropped. ``audit_meta``: facts about the chain
(``keyed_from_seq``: the first row chained with the audit key). ``usage_daily``:
usage per day and adapter or tenant, kept by the writer (rollup.py), which
records in ``usage_progress`` how far it got. Every table but these two
(derived, rebuildable) is append-only. Free text goes through
:class:`ExactText`, which keeps NUL bytes
and every other code point.
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
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import TypeDecorator

from lorapool.audit_db.exact_text import ExactText
from lorapool.audit_db.tokens import TokenArray

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


def _indexes(table: str, *columns: str) -> list[Index]:
    """An index on each of ``columns``, named ``ix_<table>_<column>``."""
    return [Index(f"ix_{table}_{column}", column) for column in columns]


def _completion_key(pool_nullable: bool) -> list[Column]:
    """What names one completion: the pool (Redis prefix), request id and index."""
    return [
        Column("pool", ExactText(), nullable=pool_nullable),
        Column("request_id", ExactText(), nullable=False),
        Column("completion_index", Integer, nullable=False),
    ]


metadata = MetaData()

adapters = Table(
    "adapters",
    metadata,
    Column("pk", BigId, primary_key=True, autoincrement=True),
    Column("fingerprint", String(64), nullable=False, unique=True),
    Column("name", ExactText(), nullable=False),
    Column("adapter_id", Integer, nullable=False),
    Column("path", ExactText(), nullable=False),
    Column("sha256", ExactText(), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("alpha", Double, nullable=False),
    Column("target_modules", JSONValue(), nullable=False),
    Column("base_model", ExactText(), nullable=True),
    Column("first_seen", Double, nullable=False),
    # revision 0008; NULL on adapters registered before config hashes (chain.py)
    Column("config_sha256", ExactText(), nullable=True),
    Column("digest", ExactText(), nullable=True),
    *_indexes("adapters", "name", "sha256", "adapter_id"),
)

completions = Table(
    "completions",
    metadata,
    Column("seq", BigId, primary_key=True, autoincrement=False),
    *_completion_key(pool_nullable=True),  # NULL on rows from before the pool was kept
    Column("adapter_pk", BigId, ForeignKey("adapters.pk"), nullable=True),
    Column("base_model_name", ExactText(), nullable=False),
    Column("base_model_sha256", ExactText(), nullable=False),
    Column("prompt", ExactText(), nullable=True),
    Column("prompt_token_ids", JSONValue(), nullable=True),  # chain version 1 rows
    Column("num_prompt_tokens", Integer, nullable=False),
    Column("text", ExactText(), nullable=False),
    Column("token_ids", JSONValue(), nullable=True),  # chain version 1 rows
    Column("num_output_tokens", Integer, nullable=False),
    Column("finish_reason", String(16), nullable=False),
    Column("stop_reason", JSONValue(), nullable=True),
    Column("cumulative_logprob", Double, nullable=True),
    Column("sampling_params", JSONValue(), nullable=False),
    Column("request_metadata", JSONValue(), nullable=False),
    Column("tenant", ExactText(), nullable=True),
    Column("worker", ExactText(), nullable=False),
    Column("arrival_time", Double, nullable=False),
    Column("first_scheduled_time", Double, nullable=True),
    Column("first_token_time", Double, nullable=True),
    Column("last_token_time", Double, nullable=True),
    Column("finished_time", Double, nullable=True),
    Column("queue_time", Double, nullable=True),
    Column("error", ExactText(), nullable=True),
    Column("written_at", Double, nullable=False),
    Column("prev_hash", String(64), nullable=False),
    Column("row_hash", String(64), nullable=False),
    Column("chain_version", SmallInteger, nullable=False, server_default="1"),
    Column("prompt_tokens", TokenArray(), nullable=True),  # chain version 2 rows
    Column("output_tokens", TokenArray(), nullable=True),  # chain version 2 rows
    Column("period", Integer, nullable=False),
    UniqueConstraint("request_id", "completion_index", "pool", name="uq_completions_pool_request"),
    # the queries' indexes: one adapter's or tenant's rows over a time window
    Index("ix_completions_adapter_time", "adapter_pk", "arrival_time"),
    Index("ix_completions_tenant_time", "tenant", "arrival_time"),
    Index("ix_completions_arrival_time", "arrival_time"),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=False),  # 1, 2, ... in order
    Column("seq", BigInteger, nullable=False),
    Column("row_hash", String(64), nullable=False),
    Column("num_rows", BigInteger, nullable=False),
    Column("keyed_from", BigInteger, nullable=True),
    Column("created_at", Double, nullable=False),
    Column("prev_signature", String(64), nullable=False),
    Column("signature", String(64), nullable=False),
    Index("ix_checkpoints_seq", "seq"),
)

archives = Table(
    "archives",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=False),
    Column("period", Integer, nullable=False),
    Column("first_seq", BigInteger, nullable=False),
    Column("last_seq", BigInteger, nullable=False),
    Column("manifest", Text, nullable=False),  # the signed manifest, as written to its file
    Column("archived_at", Double, nullable=False),
)

conflicts = Table(
    "conflicts",
    metadata,
    Column("pk", BigId, primary_key=True, autoincrement=True),
    *_completion_key(pool_nullable=False),
    Column("stored_digest", String(64), nullable=False),
    Column("refused_digest", String(64), nullable=False),
    Column("refused_row", JSONValue(), nullable=False),
    Column("source", ExactText(), nullable=True),
    Column("detected_at", Double, nullable=False),
    Index("ix_conflicts_request", "pool", "request_id"),
)

audit_meta = Table(
    "audit_meta",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", String, nullable=False),
)

usage_daily = Table(
    "usage_daily",
    metadata,
    Column("day", Integer, primary_key=True),  # days since the epoch (UTC) of arrival_time
    Column("dimension", String(8), primary_key=True),  # "adapter" or "tenant"
    Column("group_key", ExactText(), primary_key=True),  # see rollup.py
    Column("requests", BigInteger, nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    Column("errors", BigInteger, nullable=False),
    Column("latency_hist", JSONValue(), nullable=False),  # {bucket: requests}, rollup.py
)

usage_progress = Table(
    "usage_progress",
    metadata,
    Column("name", String(32), primary_key=True),  # "rolled": the rollup covers rows up to seq
    Column("seq", BigInteger, nullable=False),
)

# What a completion row holds beyond what it says: the chain's bookkeeping and
# where the row lives (chain.py names the columns each chain version hashes).
BOOKKEEPING = ("adapter_pk", "prev_hash", "row_hash", "chain_version", "period")
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
# Identity fields of revision 0008: in an adapter's fingerprint only when not NULL, so
# that the fingerprints (and so the row hashes) of adapters stored before stay the same.
ADAPTER_HASHES = ("config_sha256", "digest")
