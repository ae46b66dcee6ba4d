"""The audit trail: every final output, with its adapter's identity, in SQL.

Torch-free (SQLAlchemy, redis, orjson only). The pieces:

- ``lorapool.records.audit`` (torch-free, shared with the worker, re-exported here):
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

May import: SQLAlchemy, alembic, redis, orjson, msgspec and ``lorapool``'s
torch-free modules; never torch (checked by ``tests/unit/test_import_rules.py``).
"""

from importlib import import_module

from lorapool.audit_db.database import (
    DatabaseConfig,
    create_audit_engine,
    current_revision,
    default_url,
    head_revision,
    migrate,
)
from lorapool.audit_db.queries import (  # `usage` is also a submodule: bound here, eagerly
    SearchFilter,
    UsageRow,
    get_request,
    list_conflicts,
    search,
    usage,
)

# The rest on first use: `lorapool audit request` and the other queries need neither the
# writer, the store nor verify (~0.1 s of a CLI query's start-up).
_LAZY = {
    "ChainTampered": "store",
    "append_records": "store",
    "checkpoint_now": "store",
    "Head": "verify",
    "VerifyReport": "verify",
    "verify_chain": "verify",
    "BadRow": "walk",
    "WriterConfig": "writer_config",
    "WriterStats": "writer_config",
    "AuditWriter": "writer",
}
_RECORD = {
    "AuditRecord",
    "RecordError",
    "encode_audit_record",
    "parse_record",
    "record_from_dict",
    "record_from_output",
    "sign_record",
}


def __getattr__(name: str):
    """The package's names, each imported from its module on first use."""
    if name in _RECORD:
        return getattr(import_module("lorapool.records.audit"), name)
    if name in _LAZY:
        return getattr(import_module(f"lorapool.audit_db.{_LAZY[name]}"), name)
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
    "encode_audit_record",
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
