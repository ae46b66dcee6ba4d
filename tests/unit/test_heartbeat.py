"""A worker's heartbeat is one record (``records.heartbeat.Heartbeat``): what the worker
writes, its peers, the gateway and ``lorapool status`` read; older records still read."""

from __future__ import annotations

import orjson

from lorapool.openai.limits import pool_limits
from lorapool.records.heartbeat import (
    Heartbeat,
    consumer_of,
    decode_heartbeats,
    encode_heartbeat,
)

# ``{p}:workers``'s value as main at 89a94dd wrote it (an engine that says its bounds)
OLD = (
    b'{"name":"w1","device":"cpu","model":"base","updated":1795657032.3320224,"running":2,'
    b'"waiting":1,"held":3,"tokens_per_s":3.5,"adapters":["sql-lora"],"loaded":["sql-lora"],'
    b'"draining":false,"max_model_len":256,"max_logprobs":20,"kv_capacity_tokens":4096,'
    b'"kv_cache_usage":0.25}'
)


def test_a_record_written_before_reads_typed_and_whole():
    # its consumer in the group was its name (no incarnation then)
    [(name, heartbeat)] = decode_heartbeats({b"w1": OLD}).items()
    whole = {**orjson.loads(OLD), "consumer": None}
    assert name == "w1" and heartbeat.to_dict() == whole
    assert orjson.loads(encode_heartbeat(heartbeat)) == whole
    assert consumer_of(heartbeat) == "w1"


def test_two_processes_under_one_name_are_two_records_showing_that_name():
    records = {
        b"gpu0#1a2b3c4d": b'{"name":"gpu0","consumer":"gpu0#1a2b3c4d"}',
        b"gpu0#5e6f7a8b": b'{"name":"gpu0","consumer":"gpu0#5e6f7a8b"}',
    }
    found = decode_heartbeats(records)
    assert [consumer_of(h) for h in found.values()] == list(found)
    assert {h.name for h in found.values()} == {"gpu0"}


def test_what_is_not_a_heartbeat_is_left_out_and_missing_fields_read_empty():
    records = {
        b"w0": b'{"name":"w0"}',  # an older worker's, or an engine that says nothing
        b"junk": b"[1]",
        b"typed-wrong": b'{"name":"x","running":"2"}',
        b"not-json": b"{",
        b"w1": OLD,
    }
    found = decode_heartbeats(records)
    assert list(found) == ["w0", "w1"]
    assert found["w0"] == Heartbeat(name="w0") and found["w0"].loaded == []


def test_the_gateway_takes_the_tightest_bounds_of_the_workers_serving_its_model():
    workers = list(decode_heartbeats({b"w0": b'{"name":"w0","model":"base"}', b"w1": OLD}).values())
    small = Heartbeat(name="w2", model="base", max_model_len=128, draining=True)
    other = Heartbeat(name="w3", model="other", max_model_len=64)
    limits = pool_limits([*workers, small, other], "base")
    assert (limits.max_model_len, limits.max_logprobs, limits.kv_capacity_tokens) == (256, 20, 4096)
