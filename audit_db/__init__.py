"""The audit trail: every final output, with its adapter's identity, in SQL.

Torch-free (SQLAlchemy, redis, orjson only). The pieces:

- ``lorapool.audit_record`` (torch-free, shared with the worker, re-exported here):
  the ``{p}:audit`` record (sign, check the signature, parse, validate, build from
  a finished RequestOutput); the key is ``lorapool.signing``'s;
- :mod:`.schema`: the tables; :mod:`.chain`: the keyed hash chain of rows (compact
  token ids: :mod:`.tokens`); :mod:`.partitions`: PostgreSQL's monthly partitions;
- :mod:`.database`: engines with SQLite/PostgreSQL defaults, migrations;
- :mod:`.exact_text`: text stored exactly (NUL and every code point);
- :mod:`.rows`: records into rows; :mod:`.store`: the one append path (keyed hash
  chain, idempotent, conflicts kept), guarded by :mod:`.guard` (it extends only a
  chain that verifies from its last signed checkpoint, :mod:`.checkpoints`);
- :mod:`.writer`: the stream consumer (:mod:`.writer_config`);
- :mod:`.verify`: the whole chain or the rows since a checkpoint (:mod:`.walk`
  walks rows), against an exported head; :mod:`.archive_manifest`: months moved
  out to archive files;
- :mod:`.queries`: compliance queries and conflicts;
- :mod:`.roles`: PostgreSQL roles (owner, insert-only writer, reader).

May import: SQLAlchemy, alembic, redis, orjson and ``lorapool``'s torch-free modules;
never torch (checked by ``tests/unit/test_import_rules.py``).
"""

from lorapool.audit_db.database import (
    DatabaseConfig,
    create_audit_engine,
    current_revision,
    default_url,
    head_revision,
    migrate,
)
from lorapool.audit_db.queries import (
    SearchFilter,
    UsageRow,
    get_request,
    list_conflicts,
    search,
    usage,
)
from lorapool.audit_db.store import ChainTampered, append_records, checkpoint_now
from lorapool.audit_db.verify import Head, VerifyReport, verify_chain
from lorapool.audit_db.walk import BadRow
from lorapool.audit_db.writer_config import WriterConfig, WriterStats
from lorapool.audit_record import (
    AuditRecord,
    RecordError,
    encode_record,
    parse_record,
    record_from_dict,
    record_from_output,
    sign_record,
)


def __getattr__(name: str):
    """``AuditWriter`` on first use: it needs redis-py, which queries and ``lorapool
    audit`` commands do not (a tenth of a second less to start)."""
    if name == "AuditWriter":
        from lorapool.audit_db.writer import AuditWriter

        return AuditWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AuditRecord",
    "AuditWriter",
    "BadRow",
    "ChainTampered",
    "DatabaseConfig",
    "Head",
    "RecordError",
    "SearchFilter",
    "UsageRow",
    "VerifyReport",
    "WriterConfig",
    "WriterStats",
    "append_records",
    "checkpoint_now",
    "create_audit_engine",
    "current_revision",
    "default_url",
    "encode_record",
    "get_request",
    "head_revision",
    "list_conflicts",
    "migrate",
    "parse_record",
    "record_from_dict",
    "record_from_output",
    "search",
    "sign_record",
    "usage",
    "verify_chain",
]
