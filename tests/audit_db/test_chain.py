"""Hash chain building blocks and row preparation (no server)."""

import pytest

from lorapool.audit_db.chain import (
    GENESIS,
    adapter_fingerprint,
    canonical,
    link,
    row_body,
    row_hash,
)
from lorapool.audit_db.rows import adapter_row, prepare
from lorapool.audit_db.tokens import fits, packed, unpacked
from lorapool.records.audit import RecordError, record_from_dict

pytest_plugins = ["audit_fixtures"]


def _adapter_row():
    from audit_fixtures import make_adapter, make_record

    return adapter_row(record_from_dict(make_record(1, adapter=make_adapter())), now=1.0)


def test_canonical_ignores_key_order():
    assert canonical({"b": 1, "a": {"y": 2.5, "x": [1]}}) == canonical(
        {"a": {"x": [1], "y": 2.5}, "b": 1}
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("name", "other"),
        ("adapter_id", 9),
        ("path", "/elsewhere"),
        ("sha256", "f" * 64),
        ("rank", 16),
        ("alpha", 32.0),
        ("target_modules", ["q_proj"]),
        ("base_model", None),
    ],
)
def test_every_identity_field_changes_the_fingerprint(field, value):
    row = _adapter_row()
    assert adapter_fingerprint(row) == row["fingerprint"]
    assert adapter_fingerprint({**row, field: value}) != row["fingerprint"]


def test_link_depends_on_prev_seq_and_body():
    base = link(GENESIS, 1, b"body")
    assert len(base) == 64
    assert link("1" * 64, 1, b"body") != base
    assert link(GENESIS, 2, b"body") != base
    assert link(GENESIS, 1, b"body!") != base
    assert link(GENESIS, 1, b"body") == base


def test_prepare_makes_one_row_per_completion():
    from audit_fixtures import make_adapter, make_record

    rows = prepare(record_from_dict(make_record(3, adapter=make_adapter(), n=3)), now=5.0)
    assert [r.key for r in rows] == [("lorapool", "req-3", k) for k in range(3)]
    assert {r.adapter["fingerprint"] for r in rows} == {rows[0].adapter["fingerprint"]}
    assert rows[1].values["tenant"] == "acme" and rows[1].values["num_output_tokens"] == 3
    assert rows[0].version == 2  # compact: the token ids fit int32
    assert rows[0].body == row_body(rows[0].values, rows[0].adapter["fingerprint"], 2)
    assert rows[0].tokens == (packed(rows[0].values["prompt_token_ids"]), packed([3, 0, 7]))


def test_token_ids_outside_int32_make_a_version_1_row():
    from audit_fixtures import make_record

    data = make_record(3)
    data["outputs"][0]["token_ids"] = [1, 2**31]
    (row,) = prepare(record_from_dict(data))
    assert row.version == 1 and row.tokens is None
    assert row.body == row_body(row.values, None, 1) and b"2147483648" in row.body


def test_packed_token_ids_round_trip_as_little_endian_int32():
    ids = [0, 1, -1, 2**31 - 1, -(2**31), 49151]
    assert packed(ids)[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert unpacked(packed(ids)) == ids and packed([]) == b""
    assert fits(ids) and not fits([2**31]) and not fits([-(2**31) - 1])


def test_a_row_version_is_part_of_its_hash():
    from audit_fixtures import make_record

    (row,) = prepare(record_from_dict(make_record(3)))
    values = {**row.values, "seq": 1, "chain_version": 2}
    v2 = row_hash(values, GENESIS, None, b"k" * 32)
    assert v2 != row_hash({**values, "chain_version": 1}, GENESIS, None, b"k" * 32)
    assert v2 != row_hash(values, GENESIS, None, None)  # keyed and unkeyed differ


@pytest.mark.parametrize("error, reason", [("boom", "error"), (None, "abort")])
def test_a_request_without_outputs_still_gets_a_row(error, reason):
    from audit_fixtures import make_record

    data = make_record(4, error=error)
    data["outputs"] = []
    (row,) = prepare(record_from_dict(data))
    assert row.key == ("lorapool", "req-4", 0)
    assert row.values["finish_reason"] == reason and row.values["text"] == ""


def test_unhashable_values_are_record_errors():
    from audit_fixtures import make_record

    data = make_record(5)
    data["sampling_params"]["seed"] = 2**70
    with pytest.raises(RecordError, match="cannot hash"):
        prepare(record_from_dict(data))
