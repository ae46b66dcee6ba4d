"""An engine step longer than the lease (a loaded CPU, a huge prefill): the worker's
sender renews the lease during the step, so a peer finds nothing idle to claim and the
worker that runs a request finishes it.

A real Worker around the benchmark's stand-in engine (1.6 s steps, lease 1 s); the
peer is the same XAUTOCLAIM a worker's failover runs, every 0.1 s; the oracle of the
streams is the stand-in's deterministic output.
"""

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from standin import load

from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.lease import claim_idle
from lorapool.protocol import SamplingParams
from lorapool.records.heartbeat import decode_heartbeat
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
STALLING = Path(__file__).resolve().parents[1] / "support" / "stalling_worker.py"
STALE_S = 5.0  # the dashboard's: a heartbeat older than this is stale (dashboard_data.py)


def test_a_step_longer_than_the_lease_keeps_its_entries(conn, keys, producer):
    bench = load()
    ids = [f"long-{i}" for i in range(3)]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    producer.submit_many([{"prompt_token_ids": [1]}] * 3, params, request_ids=ids)
    config = WorkerConfig(
        prefix=keys.prefix,
        shards=keys.shards,
        name="slow",
        burst=True,
        lease_s=1.0,
        audit_key=bench.AUDIT_KEY.encode(),
    )
    worker = Worker(bench.StandInEngine(8, 1.6), conn, config, bench.BASE_MODEL)
    worker.ensure_group()  # on every shard, before the peer looks
    thread = threading.Thread(target=worker.run)
    thread.start()
    stolen = []
    while thread.is_alive():  # a peer's failover: entries idle past the lease are its
        for view in keys.shard_views:
            stolen += claim_idle(conn, view.requests, "peer", 1000, 100)
        time.sleep(0.1)
    thread.join()
    assert stolen == []
    for rid in ids:
        chunks = log_chunks(conn, keys, rid)
        tokens = [t for c in chunks for o in c.outputs for t in o.token_ids]
        assert tokens == [bench.token_of(rid, k) for k in range(2)]
        assert [c.finished for c in chunks].count(True) == 1
        assert chunks[-1].worker == "slow" and chunks[-1].error is None


def test_a_step_stalled_30s_keeps_its_jobs_and_its_heartbeat(
    pool_url, conn, keys, producer, tmp_path
):
    """A worker process (default lease 10 s, heartbeat 1 s) whose engine stalls one step
    for 30 s while it runs a job and has just read two more: a peer claiming what is idle
    past the lease finds nothing, the worker's liveness flag never expires and its
    heartbeat is never older than the dashboard's STALE_S, and the worker finishes all
    three. Before the renewer thread the heartbeat waited for the step (the dashboard
    marked the busy worker stale) and the entries read at the step's start were renewed
    by nobody until it ended (a peer took them)."""
    bench = load()
    stall = tmp_path / "stall"
    cmd = [
        sys.executable,
        str(STALLING),
        pool_url,
        keys.prefix,
        str(keys.shards),
        "staller",
        str(stall),
    ]
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen(cmd, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not conn.hkeys(keys.workers):
            assert worker.poll() is None and time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.1)
        (consumer,) = [c.decode() for c in conn.hkeys(keys.workers)]
        first = producer.submit(
            {"prompt_token_ids": [1]}, SamplingParams(max_tokens=60, ignore_eos=True)
        )
        while not log_chunks(conn, keys, first.request_id):
            assert time.monotonic() < deadline, "the first job did not start"
            time.sleep(0.05)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        more = [producer.submit({"prompt_token_ids": [1]}, params) for _ in range(2)]
        stall.touch()
        while stall.exists():
            assert time.monotonic() < deadline, "the engine never stalled"
            time.sleep(0.05)
        stalled_at, stolen, oldest = time.monotonic(), [], 0.0
        handles = [first, *more]
        while not all(h.status() == "finished" for h in handles):
            assert time.monotonic() - stalled_at < 90, [h.status() for h in handles]
            for view in keys.shard_views:  # a peer's failover
                stolen += claim_idle(conn, view.requests, "peer", 10_000, 100)
            assert conn.exists(keys.alive(consumer)), "the liveness flag expired"
            record = decode_heartbeat(conn.hget(keys.workers, consumer))
            oldest = max(oldest, time.time() - record.updated)
            assert oldest <= STALE_S, f"heartbeat {oldest:.1f}s old during the step"
            time.sleep(0.5)
        assert time.monotonic() - stalled_at >= 29  # the jobs waited for the stalled step
        assert stolen == []
        for handle in handles:
            chunks = log_chunks(conn, keys, handle.request_id)
            assert chunks[-1].worker == "staller" and chunks[-1].error is None
            tokens = [t for c in chunks for o in c.outputs for t in o.token_ids]
            n = len(tokens)
            assert tokens == [bench.token_of(handle.request_id, k) for k in range(n)]
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
