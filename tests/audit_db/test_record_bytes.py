"""Audit records as the version before the msgspec Structs wrote them (no server).

``data/audit_records_7b272de.json`` holds the bytes main wrote at 7b272de (a worker's
record of a finished request, of a failed one, a record of a request ended unread,
signed with the key it names; and an unsigned one): they still verify and parse, and
today's worker writes the same bytes, signature included, for the same request.
"""

import base64
from pathlib import Path

import orjson
import pytest

from lorapool import CompletionOutput, RequestMetrics, RequestOutput
from lorapool.records.adapter import ModelIdentity
from lorapool.records.audit import (
    RecordError,
    encode_audit_record,
    parse_record,
    record_from_output,
)

FIXTURE = orjson.loads((Path(__file__).parent / "data" / "audit_records_7b272de.json").read_bytes())
KEY, POOL = FIXTURE["audit_key"].encode(), FIXTURE["pool"]
RECORDS = {name: base64.b64decode(raw) for name, raw in FIXTURE["records"].items()}
BASE_MODEL = ModelIdentity("smol", "cd" * 32)


def finished_output() -> RequestOutput:
    # arrival, first scheduled, first token, last token, finished, in queue, counts
    times = (1_700_000_000.25, 1_700_000_000.5, 1_700_000_001.0, 1_700_000_002.125)
    metrics = RequestMetrics(*times, 1_700_000_002.5, 0.25, 3, 5)
    outputs = [
        CompletionOutput(0, 'héllo \u2028 "wörld"\n', [5, 6, 7], -2.5, None, "stop", 8),
        CompletionOutput(1, "par", [9, 2**40], None, None, None, "###"),
    ]
    return RequestOutput("req-ü-1", "say ✓ hi", [1, 2, 3], None, outputs, True, metrics=metrics)


def failed_output() -> RequestOutput:
    unfinished = CompletionOutput(0, "", [], None, None, None, None)
    return RequestOutput("req-2", None, [], None, [unfinished], True, error="CUDA out of memory")


ADAPTER = {
    "name": "sql-lora",
    "id": 3,
    "path": "/adapters/sql/v2",
    "sha256": "ab" * 32,
    "rank": 8,
    "alpha": 16,
    "target_modules": ["q_proj", "v_proj"],
    "base_model": "smol",
}


@pytest.mark.parametrize("name", ["worker", "worker_failed", "unread"])
def test_records_signed_before_verify_and_parse(name):
    record = parse_record(RECORDS[name], KEY, POOL)
    assert record.request_id == orjson.loads(RECORDS[name])["request_id"]
    with pytest.raises(RecordError, match="bad signature"):
        parse_record(RECORDS[name], KEY, POOL + "-other")


def test_an_unsigned_record_parses_without_a_key_and_is_refused_with_one():
    assert parse_record(RECORDS["unsigned_unread"]).outputs == ()
    with pytest.raises(RecordError, match="unsigned record"):
        parse_record(RECORDS["unsigned_unread"], KEY, POOL)


def test_the_worker_writes_the_same_bytes_as_before():
    written = record_from_output(
        finished_output(),
        worker="gpu-0",
        base_model=BASE_MODEL,
        adapter=ADAPTER,
        sampling_params={"temperature": 0.7, "max_tokens": 8, "stop": ["###"], "seed": None},
        metadata={"tenant": "acme", "tags": [1, 2.5, None, True]},
    )
    assert encode_audit_record(written, KEY, POOL) == RECORDS["worker"]
    failed = record_from_output(
        failed_output(), worker="gpu-1", base_model=BASE_MODEL, adapter=None
    )
    assert encode_audit_record(failed, KEY, POOL) == RECORDS["worker_failed"]


@pytest.mark.parametrize("name", ["worker_failed", "unread"])
def test_a_record_read_and_written_again_keeps_its_signature(name):
    """The signature covers the record's content, not its fields' order: the unread
    record, written with "v" last before, now has it first, signed the same. (Not
    "worker": its adapter's alpha was written as the integer 16 and reads as 16.0,
    which is why a signature is checked over the JSON as received, never over a
    record parsed and written again.)"""
    again = encode_audit_record(parse_record(RECORDS[name], KEY, POOL), KEY, POOL)
    assert orjson.loads(again) == orjson.loads(RECORDS[name])
    assert again == RECORDS[name] or name == "unread"
