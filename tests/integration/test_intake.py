"""What a worker reads and in which order (worker/intake.py), on the real Redis: the batch
stream only with capacity the interactive one left; a fair share of a burst per read.

The engine is the benchmark's GPU stand-in (``standin``), driven by the real Worker;
its record of which step first ran each request is the oracle for the order.
"""

import subprocess
import sys
import time
from collections import Counter

import orjson
import pytest
from gateway_procs import wait_until
from pool_layout import entries, length, pending
from standin import BENCH, load

from lorapool.cli.queue_status import live_workers
from lorapool.protocol import SamplingParams
from lorapool.records.job import DATA
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
SHARING = BENCH.parent / "pool_sharing.py"
PROMPT = {"prompt_token_ids": [1, 2, 3]}


def run_worker(bench, conn, keys, engine):
    key = bench.AUDIT_KEY.encode()
    config = WorkerConfig(
        prefix=keys.prefix, shards=keys.shards, name="w", audit_key=key, burst=True
    )
    Worker(engine, conn, config, bench.BASE_MODEL).run()


def test_batch_jobs_take_only_the_capacity_interactive_ones_leave(conn, keys, producer):
    bench = load()
    engine = bench.StandInEngine(max_num_seqs=4, step_s=0.002)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    batch = [f"b{i}" for i in range(10)]
    interactive = [f"i{i}" for i in range(6)]
    # the batch file is there first; interactive jobs arrive after it
    producer.submit_many([PROMPT] * 10, params, request_ids=batch, priority="batch")
    producer.submit_many([PROMPT] * 6, params, request_ids=interactive)
    assert length(conn, keys, "batch_requests") == 10
    assert length(conn, keys, "requests") == 6

    run_worker(bench, conn, keys, engine)

    first = engine.first_step
    assert set(first) == set(batch) | set(interactive)
    # the first step ran four interactive jobs; no batch job ran before the last
    # interactive one had started, and the batch file kept its own order within each
    # shard (a stream is read in order; a cluster's shards in turn: docs/batch.md)
    assert sorted(first[r] for r in interactive) == [0, 0, 0, 0, 3, 3]
    assert min(first[r] for r in batch) >= 3
    for stream in {keys.for_request(r).batch_requests for r in batch}:
        steps = [first[r] for r in batch if keys.for_request(r).batch_requests == stream]
        assert steps == sorted(steps), stream
    assert length(conn, keys, "audit") == 16
    for stream in ("requests", "batch_requests"):  # all acked and trimmed, on every shard
        assert pending(conn, keys, stream) == 0
        assert length(conn, keys, stream) == 0


def test_an_unknown_priority_is_refused_naming_it(producer):
    with pytest.raises(ValueError, match="priority must be one of interactive, batch; got 'low'"):
        producer.submit(PROMPT, request_id="x", priority="low")
    assert producer.redis.exists(producer.keys.job("x")) == 0


def start_sharing_worker(url, keys, name, *flags):
    cmd = [sys.executable, str(SHARING), "--serve-worker", "--redis-url", url]
    cmd += ["--prefix", keys.prefix, "--shards", str(keys.shards), "--name", name]
    cmd += ["--sequences", "64", "--step-ms", "20", *flags]
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL)


def served_by(conn, keys) -> Counter:
    records = [orjson.loads(f[DATA.encode()]) for _, f in entries(conn, keys, "audit")]
    return Counter(r["worker"] for r in records)


@pytest.mark.parametrize("fair", [True, False], ids=["fair-share", "no-fair-share"])
def test_a_burst_spreads_over_two_worker_processes(pool_url, conn, keys, producer, fair):
    """64 short jobs at once to two idle workers: with the fair share each serves about
    half (RESULTS.md: 'burst'); without it, whichever reads first takes most."""
    flags = [] if fair else ["--no-fair-share"]
    procs = [start_sharing_worker(pool_url, keys, n, *flags) for n in ("wa", "wb")]
    try:
        alive = lambda: {w.name for w in live_workers(conn, keys)} == {"wa", "wb"}  # noqa: E731
        wait_until(alive, "both workers", 60)
        time.sleep(2.5)  # a heartbeat or two: each has counted the other
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        producer.submit_many([PROMPT] * 64, params, request_ids=[f"r{i}" for i in range(64)])
        wait_until(lambda: length(conn, keys, "audit") >= 64, "the burst", 60)
        served = served_by(conn, keys)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    assert sum(served.values()) == 64
    if fair:
        assert min(served["wa"], served["wb"]) >= 64 * 0.3, served


def stepped_worker(conn, keys, **options):
    """A Worker around an 8-sequence stand-in stepping 10 ms (a round trip fits a step),
    run by hand with ``run_once``."""
    bench = load()
    engine = bench.StandInEngine(max_num_seqs=8, step_s=0.01)
    key = bench.AUDIT_KEY.encode()
    config = WorkerConfig(
        prefix=keys.prefix, shards=keys.shards, name="w", audit_key=key, **options
    )
    worker = Worker(engine, conn, config, bench.BASE_MODEL)
    worker.ensure_group()
    return worker, engine


def test_batch_jobs_leave_room_for_interactive_ones_that_arrive_beside_them(conn, keys, producer):
    """A batch fills at most batch_share of the sequences; an interactive job submitted
    while it runs starts at the next step instead of waiting for a batch line to end."""
    worker, engine = stepped_worker(conn, keys, batch_share=0.75)
    producer.submit(PROMPT, SamplingParams(max_tokens=1), request_id="earlier")
    while "earlier" not in engine.first_step:  # interactive traffic was seen
        worker.run_once()
    lines = [f"b{i}" for i in range(40)]
    producer.submit_many(
        [PROMPT] * 40, SamplingParams(max_tokens=30), None, lines, priority="batch"
    )
    for _ in range(5):
        worker.run_once()
    batch_running = [s[3] for s in engine.steps]
    assert max(batch_running) == 6  # 0.75 of 8: two slots stay free
    producer.submit(PROMPT, SamplingParams(max_tokens=2), request_id="i0")
    submitted_at = len(engine.steps)
    while "i0" not in engine.first_step:
        worker.run_once()
    assert engine.first_step["i0"] - submitted_at <= 2  # no batch line had to end first
    worker.publisher.flush(wait=True)
    worker.teardown()


def test_a_pool_serving_only_batches_uses_every_slot(conn, keys, producer):
    worker, engine = stepped_worker(conn, keys, batch_share=0.5)
    lines = [f"b{i}" for i in range(20)]
    producer.submit_many(
        [PROMPT] * 20, SamplingParams(max_tokens=30), None, lines, priority="batch"
    )
    for _ in range(5):
        worker.run_once()
    assert max(s[3] for s in engine.steps) == 8  # no interactive job in the window
    worker.publisher.flush(wait=True)
    worker.teardown()
