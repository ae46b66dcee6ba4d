"""An adapter's identity is one record (``records.adapter.AdapterRecord``): the
registry's, read typed by every reader, and the ``adapter`` of its audit records."""

from __future__ import annotations

import pytest

from lorapool.protocol import LoRARequest
from lorapool.records.adapter import (
    AdapterRecord,
    ModelIdentity,
    adapter_record,
    check_lora,
    decode_adapter_record,
    decode_model_identity,
    encode_adapter_record,
)
from lorapool.records.audit import AdapterInfo, record_from_dict

# ``{p}:adapters``'s value as main at 89a94dd wrote it (AdapterRegistry.add: orjson of
# {"name", "id", **describe_adapter(path)})
SHA = "990b0665f4b9c82c8d956097c96715114d268faa798bc64e92c2f116a55b1347"
OLD = (
    b'{"name":"sql-lora","id":7,"path":"/tmp/a/sql-lora","sha256":"%s","rank":4,'
    b'"alpha":4.0,"target_modules":["q_proj","v_proj"],"base_model":"/tmp/a/base"}'
) % SHA.encode()


def test_a_record_written_before_reads_typed_and_writes_back_the_same_bytes():
    record = decode_adapter_record(OLD)
    assert record == AdapterRecord(
        "sql-lora", 7, "/tmp/a/sql-lora", SHA, 4, 4.0, ("q_proj", "v_proj"),
        base_model="/tmp/a/base",
    )  # fmt: skip
    assert encode_adapter_record(record) == OLD
    assert check_lora(LoRARequest("sql-lora", 7, ""), record) == LoRARequest(
        "sql-lora", 7, "/tmp/a/sql-lora", "/tmp/a/base"
    )


@pytest.mark.parametrize(
    "raw",
    [b"{", b"[]", OLD.replace(b'"id":7', b'"id":"7"'), OLD.replace(b'"rank":4,', b"")],
)
def test_a_damaged_record_is_a_value_error(raw):
    with pytest.raises(ValueError, match="malformed adapter record"):
        decode_adapter_record(raw)


def test_the_base_model_record_reads_typed_or_is_a_value_error():
    raw = b'{"name":"smol","sha256":"%s"}' % SHA.encode()  # {p}:model, as claim_model writes
    assert decode_model_identity(raw) == ModelIdentity("smol", SHA)
    assert decode_model_identity(None) is None  # no worker has claimed the pool yet
    for damaged in (b"{", b"[]", b'{"name":"smol"}', b'{"name":1,"sha256":"0"}'):
        with pytest.raises(ValueError, match="malformed base model record"):
            decode_model_identity(damaged)


def test_the_registry_checks_the_fields_it_writes():
    info = {"path": "/p", "sha256": "s", "rank": 8, "alpha": 16, "target_modules": ["q"]}
    assert adapter_record("a", 3, info) == AdapterRecord("a", 3, "/p", "s", 8, 16.0, ("q",))
    with pytest.raises(ValueError, match=r"adapter 'a': .*\$\.rank"):
        adapter_record("a", 3, {**info, "rank": "8"})


def test_the_audit_record_carries_the_same_identity():
    assert AdapterInfo is AdapterRecord
    record = decode_adapter_record(OLD)
    audit = {
        "v": 1, "request_id": "r", "worker": "w", "base_model": {"name": "b", "sha256": "0"},
        "adapter": record.to_dict(), "metrics": {"arrival_time": 1.0, "num_prompt_tokens": 1,
        "num_generated_tokens": 0}, "outputs": [],
    }  # fmt: skip
    assert record_from_dict(audit).adapter == record
