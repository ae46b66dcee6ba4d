"""Issue 14 point 5 on SQLite and PostgreSQL: an audit trail that cannot silently
lose or accept a row, part one: exact text (NUL and every other code point), signed
records (forged, unsigned and pre-empting records are dead-lettered, the real one
lands), pools in the key and conflicts recorded. Part two (verify --head against a cut
tail and a re-chained table, the writer's role on PostgreSQL, upgrades):
test_audit_tamper.py.
"""

import uuid

import orjson
import pytest
from audit_fixtures import KEY, drain_writer
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorapool.audit_db import (
    SearchFilter,
    append_records,
    get_request,
    search,
    verify_chain,
)
from lorapool.cli.audit import audit
from lorapool.lifecycle.keys import Keys
from lorapool.records.audit import record_from_dict, sign_record

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
# every Unicode scalar value: surrogates cannot be encoded in UTF-8 (nor reach Redis)
EVERY_CODE_POINT = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)


def _drain(audit_redis, target, prefix=None):
    return drain_writer(audit_redis, target, prefix, consumer="w-trust")


def _dead(audit_redis):
    """(request id, reason) of each dead entry, by request id (a cluster's are shard by
    shard; one stream holds them in the order published)."""
    dead = [
        (orjson.loads(f[b"data"]).get("request_id"), f[b"reason"].decode())
        for _id, f in audit_redis.dead()
    ]
    return sorted(dead, key=lambda d: d[0])


def _cli(target, *args):
    return CliRunner().invoke(audit, [*target.cli_args(), *args], catch_exceptions=False)


# --- exact text -------------------------------------------------------------------


def test_every_code_point_and_nul_round_trip_through_the_writer(audit_target, audit_redis):
    from audit_fixtures import make_record

    record = make_record(1, n=2, text_for=lambda i, k: EVERY_CODE_POINT if k else "a\0\0b\0")
    record["prompt"] = "hello\x00world"
    record["error"] = "bad \x00 byte"
    record["metadata"] = {"tenant": "t\x00nant", "note": "\x00\ufdd0\ufdd1"}
    record["outputs"][0]["stop_reason"] = "\x00stop"
    audit_redis.publish([record])
    stats = _drain(audit_redis, audit_target)
    assert (stats.rows_written, stats.dead_lettered) == (2, 0)
    rows = get_request(audit_target.engine, "req-1")
    assert [r["text"] for r in rows] == ["a\0\0b\0", EVERY_CODE_POINT]
    assert rows[1]["text"].encode() == EVERY_CODE_POINT.encode()  # byte for byte
    assert rows[0]["prompt"] == "hello\x00world" and rows[0]["error"] == "bad \x00 byte"
    assert rows[0]["tenant"] == "t\x00nant" and rows[0]["stop_reason"] == "\x00stop"
    assert rows[0]["request_metadata"] == record["metadata"]
    assert verify_chain(audit_target.engine, key=KEY).ok
    day = {"since": 1_700_000_000.0, "until": 1_700_086_400.0}  # short needles need a window
    found = search(audit_target.engine, SearchFilter(text="\0b", **day))
    assert [(r["request_id"], r["completion_index"]) for r in found] == [("req-1", 0)]
    # the first text's NUL is stored as U+FDD0 U+FDD1, yet only the second has U+FDD1
    found = search(audit_target.engine, SearchFilter(text="\ufdd1", **day))
    assert [r["completion_index"] for r in found] == [1]
    assert search(audit_target.engine, SearchFilter(tenant="t\x00nant"))[0]["prompt"] == (
        "hello\x00world"
    )
    listed = orjson.loads(_cli(audit_target, "request", "req-1", "--format", "json").output)
    assert listed[0]["text"] == "a\0\0b\0"


def test_redelivery_and_conflicts_are_found_for_keys_with_nul_and_the_escapes(audit_target):
    """The append path looks a batch's keys up (on PostgreSQL with one array parameter,
    in the stored, escaped form): a key with NUL, ESC or MARK in its request id or
    pool is found again, so a redelivery is a duplicate and a changed record a
    conflict, never a second row or a refused batch."""
    from audit_fixtures import make_record

    from lorapool.audit_db.rows import prepare
    from lorapool.audit_db.store import append

    pools = ["p\0ool", "p\ufdd0\ufdd1"]
    records = []
    for i, rid in enumerate(["r\0" + uuid.uuid4().hex, "\ufdd0\ufdd1\\\t" + uuid.uuid4().hex]):
        record = make_record(i)
        record["request_id"] = rid
        records.append(record_from_dict(record))
    rows = [row for pool in pools for r in records for row in prepare(r, pool)]
    assert append(audit_target.engine, rows, KEY).written == 4
    again = append(audit_target.engine, rows, KEY)
    assert (again.written, again.duplicates, again.conflicts) == (0, 4, [])
    changed = make_record(0, text_for=lambda i, k: "something else")
    changed["request_id"] = records[0].request_id
    found = append(audit_target.engine, prepare(record_from_dict(changed), pools[0]), KEY)
    assert found.written == 0 and [c.row.key for c in found.conflicts] == [
        (pools[0], records[0].request_id, 0)
    ]
    assert verify_chain(audit_target.engine, key=KEY).ok


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.text(), min_size=1, max_size=3), st.text())
def test_any_text_round_trips(audit_target, texts, prompt):
    from audit_fixtures import make_record

    rid = uuid.uuid4().hex
    record = make_record(0, n=len(texts), text_for=lambda i, k: texts[k])
    record.update(request_id=rid, prompt=prompt)
    append_records(audit_target.engine, [record_from_dict(record)], key=KEY)
    rows = get_request(audit_target.engine, rid)
    assert [r["text"] for r in rows] == texts and rows[0]["prompt"] == prompt


# --- authenticated records ---------------------------------------------------------


def test_forged_unsigned_and_pre_empting_records_are_dead_lettered(audit_target, audit_redis):
    from audit_fixtures import make_record

    def said(i, what):
        return make_record(i, text_for=lambda _i, _k: what)

    forged = sign_record(said(1, "forged"), b"not-the-key-" * 4, audit_redis.prefix)
    other_pool = sign_record(said(2, "for another pool"), KEY, "another-pool")
    audit_redis.publish([forged, other_pool], signed=False)  # as an attacker puts them
    audit_redis.publish([said(3, "pre-empting")], signed=False)  # unsigned, before the real one
    audit_redis.publish([said(i, f"real {i}") for i in (1, 2, 3)])  # the workers' records
    stats = _drain(audit_redis, audit_target)
    assert (stats.rows_written, stats.dead_lettered, stats.conflicts) == (3, 3, 0)
    texts = {rid: get_request(audit_target.engine, rid)[0]["text"] for rid in ("req-1", "req-2")}
    assert texts == {"req-1": "real 1", "req-2": "real 2"}
    assert get_request(audit_target.engine, "req-3")[0]["text"] == "real 3"
    dead = _dead(audit_redis)
    assert [rid for rid, _ in dead] == ["req-1", "req-2", "req-3"]
    assert "bad signature" in dead[0][1] and "bad signature" in dead[1][1]
    assert "unsigned record" in dead[2][1]
    assert audit_redis.pending() == 0


def test_one_request_id_in_two_pools_gives_two_rows(audit_target, audit_redis):
    from audit_fixtures import make_record

    other = f"{audit_redis.prefix}-b"
    try:
        for prefix in (audit_redis.prefix, other):
            record = make_record(7)
            record["outputs"][0]["text"] = prefix
            record = sign_record(record, KEY, prefix)
            stream = Keys(prefix, audit_redis.shards).for_request("req-7").audit
            audit_redis.conn.xadd(stream, {"data": orjson.dumps(record)})
            assert _drain(audit_redis, audit_target, prefix).rows_written == 1
    finally:  # the writer made every shard's stream (its group's)
        for view in Keys(other, audit_redis.shards).shard_views:
            audit_redis.conn.delete(view.audit)
    rows = get_request(audit_target.engine, "req-7")
    assert sorted((r["pool"], r["text"]) for r in rows) == sorted(
        [(audit_redis.prefix, audit_redis.prefix), (other, other)]
    )
    assert [r["pool"] for r in get_request(audit_target.engine, "req-7", pool=other)] == [other]
    assert verify_chain(audit_target.engine, key=KEY).ok


def test_a_different_record_for_a_stored_key_is_a_reported_conflict(audit_target, audit_redis):
    from audit_fixtures import make_record

    first = make_record(5, text_for=lambda i, k: "first answer")
    second = make_record(5, text_for=lambda i, k: "a different answer")
    ids = audit_redis.publish([first, first, second, second])  # a redelivery is not a conflict
    stats = _drain(audit_redis, audit_target)
    assert (stats.rows_written, stats.duplicates, stats.conflicts) == (1, 1, 2)
    assert get_request(audit_target.engine, "req-5")[0]["text"] == "first answer"
    result = _cli(audit_target, "conflicts", "--format", "json")
    assert result.exit_code == 1
    found = orjson.loads(result.output)
    assert [(c["request_id"], c["completion_index"], c["source"]) for c in found] == [
        ("req-5", 0, ids[2].decode()),
        ("req-5", 0, ids[3].decode()),
    ]
    assert found[0]["refused_row"]["text"] == "a different answer"
    assert found[0]["stored_digest"] != found[0]["refused_digest"]
    assert "req-5" in _cli(audit_target, "conflicts").output
