"""The writer's decoder of ``{p}:audit`` entries: what ``parse_record`` answers, for
a fraction of its cost.

``lorapool.records.audit.record_from_dict`` validates a record field by field in
Python: ~30 µs of the writer's ~150 µs of CPU a row (RESULTS.md, helper 53). Here
msgspec builds the same frozen dataclasses from the decoded JSON, checking every
field against its annotation in C (bools are not integers, finish reasons are the
``FinishReason`` literal, optional fields take the dataclasses' defaults); the
checks an annotation cannot say follow (the record's version, a non-empty request
id, distinct completion indices). A record msgspec refuses goes to
``record_from_dict``, which either accepts it (a null where the wire allows an
empty list, say) or raises the readable :class:`RecordError`: the records accepted,
the values built and the reasons given are ``parse_record``'s
(``tests/audit_db/test_record.py`` compares the two).
"""

from __future__ import annotations

from typing import Any

import msgspec

from lorapool.records.audit import (
    RECORD_VERSION,
    AuditRecord,
    decode_signed,
    record_from_dict,
)


def record_from_json(data: Any) -> AuditRecord:
    """A decoded JSON record (dicts, lists, str, int, float, bool, None) validated;
    raises :class:`RecordError` as ``record_from_dict`` does."""
    if type(data) is dict and data.get("v") == RECORD_VERSION:
        try:
            record = msgspec.convert(data, AuditRecord, strict=True)
        except msgspec.ValidationError:
            record = None
        if record is not None and record.request_id and _distinct(record):
            return record
    return record_from_dict(data)


def _distinct(record: AuditRecord) -> bool:
    indices = {output.index for output in record.outputs}
    return len(indices) == len(record.outputs)


def parse(payload: bytes | str, key: bytes | None = None, pool: str | None = None) -> AuditRecord:
    """``parse_record(payload, key, pool)``: decode, authenticate, validate."""
    return record_from_json(decode_signed(payload, key, pool))
