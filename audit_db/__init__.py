"""The audit trail: every final output, with its adapter's identity, in SQL.

Torch-free (SQLAlchemy, redis, orjson only). The pieces:

- :mod:`.record`: the ``{p}:audit`` record (parse, validate, build from a
  finished RequestOutput);
- :mod:`.database`: engines with SQLite/PostgreSQL defaults, migrations;
- :mod:`.store`: the one append path (hash-chained, idempotent);
- :mod:`.writer`: the stream consumer;
- :mod:`.verify`: walking the hash chain;
- :mod:`.queries`: compliance queries.

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
from lorapool.audit_db.queries import SearchFilter, UsageRow, get_request, search, usage
from lorapool.audit_db.record import (
    AuditRecord,
    RecordError,
    encode_record,
    parse_record,
    record_from_dict,
    record_from_output,
)
from lorapool.audit_db.store import append_records
from lorapool.audit_db.verify import BadRow, VerifyReport, verify_chain
from lorapool.audit_db.writer import AuditWriter, WriterConfig, WriterStats

__all__ = [
    "AuditRecord",
    "AuditWriter",
    "BadRow",
    "DatabaseConfig",
    "RecordError",
    "SearchFilter",
    "UsageRow",
    "VerifyReport",
    "WriterConfig",
    "WriterStats",
    "append_records",
    "create_audit_engine",
    "current_revision",
    "default_url",
    "encode_record",
    "get_request",
    "head_revision",
    "migrate",
    "parse_record",
    "record_from_dict",
    "record_from_output",
    "search",
    "usage",
    "verify_chain",
]
