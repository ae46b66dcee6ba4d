"""APPEND reads a request's job marker once a run, not once a chunk (issue 31's
acceptance: the queue path does not regress; the marker's HMGET per chunk cost Redis
about 16% more CPU per token). A worker's first chunk asks whether the marker names
its entry (ASK); once it does, its next chunks skip the read (SKIP), fenced by the
pending list instead. What the per-chunk read refused is still refused: a second entry
of the id, a chunk after another worker claimed or finished the entry.
"""

import pytest
import redis
from redis_server import RedisServer
from standin import load

from lorapool.connection import register_script
from lorapool.lifecycle.append import (
    ANSWERED,
    ASK,
    NAMED,
    NOT_OWNER,
    SKIP,
    VANISHED,
    Append,
    append_call,
    append_script,
)
from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")


def append(conn, keys, consumer, *items):
    script = register_script(conn, append_script(conn))
    return script(**append_call(keys, consumer, 100, 60, list(items)))


def test_a_run_reads_its_marker_once_and_stays_fenced(conn, keys, producer):
    shard = keys.for_request("r")
    conn.xgroup_create(shard.requests, WORKERS_GROUP, id="0", mkstream=True)
    producer.submit({"prompt_token_ids": [1]}, SamplingParams(max_tokens=4), request_id="r")
    entry = conn.hget(keys.job("r"), "entry").decode()
    conn.xreadgroup(WORKERS_GROUP, "w", {shard.requests: ">"})
    first = Append("r", entry, 0, b'{"s":0,"c":[]}', False, fence=ASK)
    assert append(conn, shard, "w", first) == [NAMED]  # the marker SUBMIT made names it
    conn.set(keys.abort("r"), 1)
    skip = Append("r", entry, 1, b'{"s":1,"c":[]}', False, fence=SKIP)
    assert append(conn, shard, "w", skip) == [NAMED + 1]  # abort asked, still read
    # a second entry of the id (a raw XADD) is refused at its first chunk
    twin = conn.xadd(shard.requests, {"data": "{}"}).decode()
    conn.xreadgroup(WORKERS_GROUP, "w2", {shard.requests: ">"})
    twins = Append("r", twin, 2, b'{"s":2,"c":[]}', False, fence=ASK)
    assert append(conn, shard, "w2", twins) == [ANSWERED]
    # the entry claimed by another worker: the pending list fences the skipping one
    conn.xclaim(shard.requests, WORKERS_GROUP, "w2", 0, [entry])
    assert append(conn, shard, "w", skip._replace(seq=2)) == [NOT_OWNER]
    final = Append("r", entry, 2, b'{"s":2,"c":[],"f":1}', True, b"a", 600, result=b"whole")
    assert append(conn, shard, "w2", final) == [0]
    assert append(conn, shard, "w", skip._replace(seq=3)) == [VANISHED]  # acked
    assert conn.llen(keys.out("r")) == 3 and conn.xlen(shard.audit) == 1
    # no marker (a raw XADD's request): the marker is never read (issue 48), its first
    # chunk claims the run all the same
    other = keys.for_request("q")
    if other.requests != shard.requests:  # another shard's stream (a cluster)
        conn.xgroup_create(other.requests, WORKERS_GROUP, id="0", mkstream=True)
    raw = conn.xadd(other.requests, {"data": "{}"}).decode()
    conn.xreadgroup(WORKERS_GROUP, "w", {other.requests: ">"})
    assert append(conn, other, "w", Append("q", raw, 0, b"{}", False, fence=ASK)) == [NAMED]


@pytest.mark.layouts("standalone")
def test_a_worker_reads_each_marker_once_a_run(tmp_path):
    """The real Worker loop around the stand-in, on a Redis of its own: HMGET (APPEND's
    marker read; nothing else of the worker's loop runs it) about twice a request (its
    first chunk and its final), not once a chunk; every stream exact."""
    bench = load()
    server = RedisServer(tmp_path / "redis").start()
    try:
        conn, prefix = redis.Redis.from_url(server.url), "once"
        ids = [f"m{i}" for i in range(6)]
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        producer = Producer(conn, prefix=prefix)
        producer.submit_many([{"prompt_token_ids": [1, 2]}] * len(ids), params, request_ids=ids)
        config = WorkerConfig(
            prefix=prefix, name="w", audit_key=bench.AUDIT_KEY.encode(), max_chunk_rate=0
        )
        worker = Worker(bench.StandInEngine(8, 0.002), conn, config, bench.BASE_MODEL)
        worker.ensure_group()
        conn.config_resetstat()
        while conn.xlen(producer.keys.audit) < len(ids):
            worker.run_guarded()
        calls = conn.info("commandstats")["cmdstat_hmget"]["calls"]
        chunks = {rid: log_chunks(conn, producer.keys, rid) for rid in ids}
        worker.teardown()
    finally:
        server.stop()
    for rid, logged in chunks.items():
        tokens = [t for c in logged for o in c.outputs for t in o.token_ids]
        assert tokens == [bench.token_of(rid, k) for k in range(30)]
    num_chunks = sum(len(logged) for logged in chunks.values())
    assert num_chunks >= 10 * len(ids)  # chunks of a few tokens at most: many a request
    assert calls <= 2 * len(ids), (calls, num_chunks)
