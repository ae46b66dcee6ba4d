"""The queue path at GPU step rates, attacked: 10,000 requests through two worker
processes (the real Worker around the benchmark's stand-in engine, 256 sequences),
one SIGKILLed and one SIGSTOPped past its lease mid-run; on a standalone Redis and on
a 3-master Redis Cluster with the pool in 3 shards.

Oracle: the stand-in's output is a fixed function of (request id, position)
(``token_of``), so every stream read back must equal it token for token, whatever
worker made which part; each request has exactly one final chunk and one audit
record; nothing stays pending.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from standin import BENCH, load

from lorapool.connection import connect
from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REQUESTS, LEASE_S = 10_000, 1.0


@pytest.fixture(params=["standalone", "cluster"])
def pool(request, redis_url):
    """(URL, client, keys) of a fresh pool: on the test Redis, or on the Redis Cluster of
    ``$LORAPOOL_TEST_CLUSTER_URL`` in 3 shards; every key of it deleted afterwards."""
    url = redis_url
    if request.param == "cluster":
        url = os.environ.get("LORAPOOL_TEST_CLUSTER_URL")
        if not url:
            pytest.skip("no LORAPOOL_TEST_CLUSTER_URL (a Redis Cluster node; .ci/redis-cluster)")
    keys = Keys(f"test-{uuid.uuid4().hex[:10]}", 3 if request.param == "cluster" else 0)
    conn = connect(url)
    yield url, conn, keys
    for key in list(conn.scan_iter(match=keys.pattern)):
        conn.delete(key)
    conn.close()


def start(redis_url, keys, name, logs: Path):
    cmd = [sys.executable, str(BENCH), "--serve-worker", "--redis-url", redis_url]
    cmd += ["--prefix", keys.prefix, "--shards", str(keys.shards), "--name", name]
    cmd += ["--sequences", "256", "--step-ms", "2", "--lease-s", str(LEASE_S)]
    with open(logs / f"{name}.log", "w") as log:
        return subprocess.Popen(cmd, stderr=log)


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def total(conn, keys, name: str) -> int:
    """The length of stream ``name`` (audit, requests, dead) summed over the shards."""
    return sum(conn.xlen(getattr(view, name)) for view in keys.shard_views)


def test_ten_thousand_requests_through_a_kill_and_a_stop(pool, tmp_path):
    redis_url, conn, keys = pool
    bench = load()
    producer = Producer(conn, prefix=keys.prefix, shards=keys.shards)
    # 4-16 tokens; every 50th 400, so that the stopped worker wakes while the spare still
    # runs requests it took from it (its appends then race the spare's)
    jobs = [(f"g{i}", 400 if i % 50 == 0 else 4 + (i * 7) % 13) for i in range(REQUESTS)]
    workers = [start(redis_url, keys, n, tmp_path) for n in ("gpu-a", "gpu-b")]
    spare = None
    try:
        wait_for(lambda: conn.hlen(keys.workers) == 2, 60, "both workers")
        for at in range(0, REQUESTS, 1000):
            part = jobs[at : at + 1000]
            producer.submit_many(
                [{"prompt_token_ids": [1, 2, 3]}] * len(part),
                [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in part],
                request_ids=[rid for rid, _ in part],
            )
        # mid-run: worker a dies at once, worker b freezes past its lease
        wait_for(lambda: total(conn, keys, "audit") >= REQUESTS // 5, 120, "a fifth done")
        workers[0].kill()
        wait_for(lambda: total(conn, keys, "audit") >= 2 * REQUESTS // 5, 120, "two fifths")
        workers[1].send_signal(signal.SIGSTOP)
        spare = start(redis_url, keys, "gpu-c", tmp_path)  # takes over both after the lease
        time.sleep(2.5 * LEASE_S)
        workers[1].send_signal(signal.SIGCONT)  # wakes fenced: its appends are refused
        wait_for(lambda: total(conn, keys, "audit") >= REQUESTS, 300, "every request")
        time.sleep(2 * LEASE_S)  # anything a woken worker still sends lands now
    finally:
        for proc in [*workers, spare]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in [*workers, spare]:
            if proc is not None:
                proc.wait(60)

    # the faults hit work in flight: the spare claimed entries of the other two, and
    # all three finished requests
    assert "claimed" in (tmp_path / "gpu-c.log").read_text()
    finishers = set()
    wrong = []
    for rid, max_tokens in jobs:
        chunks = log_chunks(conn, keys, rid)
        tokens = [t for c in chunks for o in c.outputs for t in o.token_ids]
        finals = sum(c.finished for c in chunks)
        seqs = [c.seq for c in chunks]
        finishers.update(c.worker for c in chunks if c.finished)
        if (
            tokens != [bench.token_of(rid, k) for k in range(max_tokens)]
            or finals != 1
            or seqs != list(range(len(chunks)))
        ):
            wrong.append((rid, tokens, finals, seqs))
    assert not wrong, f"{len(wrong)} streams differ, first: {wrong[:2]}"
    assert finishers == {"gpu-a", "gpu-b", "gpu-c"}
    assert total(conn, keys, "audit") == REQUESTS  # one audit record each
    for view in keys.shard_views:
        assert conn.xpending(view.requests, "workers")["pending"] == 0
    assert total(conn, keys, "requests") == 0 and total(conn, keys, "dead") == 0
