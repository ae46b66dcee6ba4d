"""The APPEND script against real Redis servers: fencing, duplicates, a refused write
(out of memory) failing the call instead of passing for a duplicate, a key of another
type failing its item alone, before any write; and a worker that rides out a Redis out
of memory without losing a token.
"""

import logging
import time

import pytest
import redis
from redis_server import RedisServer
from standin import load

from lorapool.connection import register_script
from lorapool.lifecycle.append import (
    ANSWERED,
    BAD_LOG,
    BAD_MARKER,
    CLAIMED_TTL_S,
    DUPLICATE,
    NOT_OWNER,
    Append,
    append_call,
    append_script,
)
from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.keys import WORKERS_GROUP, Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")


def owned_entry(conn, keys: Keys, consumer: str) -> str:
    conn.xgroup_create(keys.requests, WORKERS_GROUP, id="0", mkstream=True)
    entry = conn.xadd(keys.requests, {"data": "{}"}).decode()
    conn.xreadgroup(WORKERS_GROUP, consumer, {keys.requests: ">"})
    return entry


def append(conn, keys, consumer, *items, **ttl):
    """One APPEND call, as a worker makes it (SPUBLISH and ``#!lua`` on a cluster)."""
    script = register_script(conn, append_script(conn))
    return script(**append_call(keys, consumer, 100, 60, list(items), **ttl))


def test_fenced_by_owner_and_by_seq(conn, keys):
    keys = keys.for_request("r")  # APPEND takes one shard's items: those of "r"'s shard
    entry = owned_entry(conn, keys, "w")
    chunk = Append("r", entry, 0, b"c0", False)
    assert append(conn, keys, "w", chunk) == [0]
    assert append(conn, keys, "w", chunk) == [DUPLICATE]  # a trip sent again
    assert append(conn, keys, "other", chunk._replace(seq=1)) == [NOT_OWNER]
    conn.set(keys.abort("r"), 1)
    assert append(conn, keys, "w", chunk._replace(seq=1, chunk=b"c1")) == [1]  # abort asked
    assert conn.lrange(keys.out("r"), 0, -1) == [b"c0", b"c1"]  # at index seq


def test_a_claimed_run_key_expires_unless_its_run_ends(conn, keys):
    """The run key a first chunk claims (``entry`` only) expires ``CLAIMED_TTL_S``
    later: a worker killed between claim and end, its entry never run again, does not
    leave it for good. The final sets the job's own TTL. Expired under a live run (one
    longer than the TTL), the next chunk of the same entry claims it again."""
    keys = keys.for_request("r")
    entry = owned_entry(conn, keys, "w")
    assert append(conn, keys, "w", Append("r", entry, 0, b"c0", False)) == [0]
    assert conn.hgetall(keys.run("r")) == {b"entry": entry.encode()}
    assert CLAIMED_TTL_S - 60 < conn.ttl(keys.run("r")) <= CLAIMED_TTL_S
    final = Append("r", entry, 1, b'{"s":1,"c":[],"f":1}', True, audit=b"a", ttl_s=600)
    assert append(conn, keys, "w", final._replace(result=b"whole")) == [0]
    assert 0 < conn.ttl(keys.run("r")) <= 600
    keys = keys.for_request("q")
    if not conn.exists(keys.requests):  # "q" on another shard (a cluster)
        conn.xgroup_create(keys.requests, WORKERS_GROUP, id="0", mkstream=True)
    entry = conn.xadd(keys.requests, {"data": "{}"}).decode()
    conn.xreadgroup(WORKERS_GROUP, "w", {keys.requests: ">"})
    assert append(conn, keys, "w", Append("q", entry, 0, b"c0", False), claimed_ttl_s=1) == [0]
    deadline = time.monotonic() + 10
    while conn.exists(keys.run("q")):
        assert time.monotonic() < deadline, "the claimed run key did not expire"
        time.sleep(0.1)
    assert append(conn, keys, "w", Append("q", entry, 1, b"c1", False)) == [0]
    assert conn.hget(keys.run("q"), "entry") == entry.encode()


def test_no_chunk_after_a_final_one_when_no_marker_says(conn, keys):
    """Issue 31, Build 3, where the marker cannot tell (a raw XADD has none, an operator
    deleted it, a producer SET it to another type): the log's final chunk refuses any
    later chunk of the request id, a vanished entry's error chunk too, and nothing more
    is audited."""
    keys = keys.for_request("r")
    entry = owned_entry(conn, keys, "w")
    final = dict(audit=b"a", ttl_s=600, result=b"whole")
    assert append(
        conn, keys, "w", Append("r", entry, 0, b'{"s":0,"c":[],"f":1}', True, **final)
    ) == [0]
    conn.delete(keys.run("r"))  # compaction wrote it; an operator deletes it
    twin = conn.xadd(keys.requests, {"data": "{}"}).decode()  # a raw duplicate entry
    conn.xreadgroup(WORKERS_GROUP, "w", {keys.requests: ">"})
    assert append(conn, keys, "w", Append("r", twin, 1, b'{"s":1,"c":[]}', False)) == [ANSWERED]
    vanished = Append("r", entry, 1, b'{"s":1,"c":[],"f":1}', True, **final, vanished=True)
    assert append(conn, keys, "w", vanished) == [ANSWERED]  # its entry acked: pending to no one
    conn.set(keys.run("r"), "not a hash")
    assert append(conn, keys, "w", Append("r", twin, 1, b'{"s":1,"c":[]}', False)) == [ANSWERED]
    assert conn.llen(keys.out("r")) == 1 and conn.xlen(keys.audit) == 1
    conn.delete(keys.run("r"), keys.out("r"))  # nothing says it ran: no error final either
    assert append(conn, keys, "w", vanished._replace(seq=0)) == [ANSWERED]
    assert conn.exists(keys.out("r")) == 0 and conn.xlen(keys.audit) == 1


# Standalone only, from here: a redis-server of their own, made to run out of memory.
@pytest.fixture
def private_redis(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def test_a_refused_write_fails_the_call_instead_of_passing_for_a_duplicate(private_redis):
    conn, keys = redis.Redis.from_url(private_redis.url), Keys("t")
    entry = owned_entry(conn, keys, "w")
    assert append(conn, keys, "w", Append("r", entry, 0, b"c0", False)) == [0]
    conn.config_set("maxmemory", 1)  # every write refused (noeviction)
    with pytest.raises(redis.ResponseError, match="OOM|maxmemory"):
        append(conn, keys, "w", Append("r", entry, 1, b"c1", False))
    conn.config_set("maxmemory", 0)
    assert conn.llen(keys.out("r")) == 1


def test_a_key_of_another_type_is_the_items_result_and_nothing_is_written(private_redis):
    """A log key that is not a list: BAD_LOG for that item alone, nothing written for
    it (no ack, no audit record), the other items of the call go through. A run key
    that is not a hash (an operator's SET; only workers may write it): the request
    finishes, the key is left alone (BAD_MARKER), the log kept for the result's TTL."""
    conn, keys = redis.Redis.from_url(private_redis.url), Keys("t")
    entry = owned_entry(conn, keys, "w")
    second = conn.xadd(keys.requests, {"data": "{}"}).decode()
    conn.xreadgroup(WORKERS_GROUP, "w", {keys.requests: ">"})
    conn.set(keys.out("s"), "not a list")
    conn.set(keys.run("r"), "not a hash")
    final = dict(audit=b"a", ttl_s=600, result=b"whole")
    items = [
        Append("s", entry, 0, b"c0", True, **final),
        Append("r", second, 0, b"c0", True, **final),
    ]
    assert append(conn, keys, "w", *items) == [BAD_LOG, BAD_MARKER]
    assert conn.get(keys.out("s")) == b"not a list" and conn.get(keys.run("r")) == b"not a hash"
    assert conn.lrange(keys.out("r"), 0, -1) == [b"c0"]
    assert 60 < conn.ttl(keys.out("r")) <= 600  # the only record: kept for the TTL
    pending = conn.xpending_range(keys.requests, WORKERS_GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [entry]  # only "r" acked
    assert conn.xlen(keys.audit) == 1


def test_worker_rides_out_redis_out_of_memory(private_redis, caplog):
    bench = load()
    conn, prefix = redis.Redis.from_url(private_redis.url), "oom"
    producer = Producer(private_redis.url, prefix=prefix)
    ids = [f"m{i}" for i in range(4)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    producer.submit_many([{"prompt_token_ids": [1, 2]}] * 4, params, request_ids=ids)
    config = WorkerConfig(prefix=prefix, name="w", audit_key=bench.AUDIT_KEY.encode())
    worker = Worker(bench.StandInEngine(8, 0.001), conn, config, bench.BASE_MODEL)
    worker.ensure_group()
    keys = producer.keys
    while conn.llen(keys.out(ids[0])) < 5:
        worker.run_guarded()
    conn.config_set("maxmemory", 1)
    with caplog.at_level(logging.WARNING, logger="lorapool.worker.worker"):
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            worker.run_guarded()  # never raises
    assert "Redis is out of memory" in caplog.text
    with pytest.raises(redis.OutOfMemoryError):  # a producer is told, nothing is queued
        producer.submit({"prompt_token_ids": [1]}, params, request_id="late")
    conn.config_set("maxmemory", 0)
    deadline = time.monotonic() + 30
    assert conn.xlen(keys.requests) == len(ids)
    while conn.xlen(keys.audit) < len(ids):
        assert time.monotonic() < deadline, "requests did not finish after Redis had room"
        worker.run_guarded()
    for rid in ids:
        chunks = log_chunks(conn, keys, rid)
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        tokens = [t for c in chunks for o in c.outputs for t in o.token_ids]
        assert tokens == [bench.token_of(rid, k) for k in range(30)]
        assert sum(c.finished for c in chunks) == 1
    worker.teardown()


@pytest.mark.parametrize("deleted", [("job",), ("job", "out")])
def test_a_fenced_worker_ends_nothing_twice_when_the_marker_is_gone(private_redis, deleted):
    """A worker stopped past its lease while another claims and finishes its request,
    whose marker (and log) an operator then deletes: woken, it finds the entry pending
    to no one and must not add an error chunk after the final one, nor a second audit
    record (the stateful test's finds: the marker alone fenced it; with the log gone
    too, nothing in Redis says it still runs, and APPEND refuses its error final)."""
    bench = load()
    conn, keys = redis.Redis.from_url(private_redis.url), Keys("fence")

    def worker(name):
        config = WorkerConfig(
            prefix=keys.prefix,
            name=name,
            audit_key=bench.AUDIT_KEY.encode(),
            lease_s=1,
            block_ms=10,
        )
        made = Worker(bench.StandInEngine(8, 0.001), conn, config, bench.BASE_MODEL)
        made.ensure_group()
        return made

    stopped, other = worker("stopped"), worker("other")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    Producer(conn, prefix=keys.prefix).submit({"prompt_token_ids": [1]}, params, request_id="r")
    while "r" not in stopped.held:
        stopped.run_guarded()
    time.sleep(1.1)  # stopped past its lease
    deadline = time.monotonic() + 10
    while conn.xlen(keys.audit) == 0:
        assert time.monotonic() < deadline, "the other worker did not claim and finish it"
        other.run_guarded()
    conn.delete(*[getattr(keys, key)("r") for key in deleted])
    deadline = time.monotonic() + 3
    while "r" in stopped.held or time.monotonic() < deadline:
        stopped.run_guarded()
    chunks = log_chunks(conn, keys, "r")
    if "out" in deleted:
        assert chunks == []  # nothing written after the operator's DEL
    else:
        assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert chunks[-1].worker == "other" and chunks[-1].error is None
    assert conn.xlen(keys.audit) == 1 and conn.xlen(keys.dead) == 0
    stopped.teardown()
    other.teardown()
