"""The multiplexed reader: one connection follows hundreds of live requests exactly.

A real Worker around the benchmark's stand-in engine (a process, 5 ms steps) streams
them; the oracle is the stand-in's output, a fixed function of (request id,
position). The follower's Pub/Sub connection is cut mid-run: what was published
meanwhile comes from the logs, so every stream is still exact.
"""

import asyncio
import subprocess
import sys
import time

import pytest
from standin import BENCH, load

from lorapool.producer import AsyncProducer
from lorapool.protocol import SamplingParams

pytestmark = pytest.mark.integration
REQUESTS = 200


def start_worker(redis_url, prefix, tmp_path):
    cmd = [sys.executable, str(BENCH), "--serve-worker", "--redis-url", redis_url]
    cmd += ["--prefix", prefix, "--name", "follow-w", "--sequences", "64", "--step-ms", "5"]
    with open(tmp_path / "worker.log", "w") as log:
        return subprocess.Popen(cmd, stderr=log)


async def follow_all(redis_url, prefix, jobs, cut_after_s):
    producer = AsyncProducer(redis_url, prefix=prefix)
    handles = await producer.submit_many(
        [{"prompt_token_ids": [1, 2, 3]}] * len(jobs),
        [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in jobs],
        request_ids=[rid for rid, _ in jobs],
    )

    async def read(handle):
        return [chunk async for chunk in handle.chunks(timeout=120)]

    async def cut():
        await asyncio.sleep(cut_after_s)
        await producer.follower.pubsub.connection.disconnect()  # in-flight messages lost

    reads = asyncio.gather(*(read(h) for h in handles))
    _, logs = await asyncio.gather(cut(), reads)
    follower = producer.follower
    await producer.aclose()
    return logs, follower


def test_one_connection_follows_every_stream_exactly(redis_url, conn, prefix, tmp_path):
    bench = load()
    jobs = [(f"f{i}", 4 + (i * 7) % 60) for i in range(REQUESTS)]
    worker = start_worker(redis_url, prefix, tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not conn.hlen(f"{prefix}:workers"):
            assert worker.poll() is None and time.monotonic() < deadline, "worker did not start"
            time.sleep(0.05)
        logs, follower = asyncio.run(follow_all(redis_url, prefix, jobs, cut_after_s=0.5))
    finally:
        worker.terminate()
        worker.wait(30)
    for (rid, n), log in zip(jobs, logs):
        assert [c.seq for c in log] == sorted({c.seq for c in log})  # in order, no repeat
        assert [c.finished for c in log].count(True) == 1 and log[-1].finished
        tokens = [t for c in log for o in c.outputs for t in o["token_ids"]]
        assert tokens == [bench.token_of(rid, k) for k in range(n)], rid
    total = sum(len(log) for log in logs)
    assert follower.num_live + follower.num_filled == total
    # both ways were taken: the channel, and the logs for what the cut lost
    assert follower.num_live > 0 and follower.num_filled > 0


def test_a_compacted_log_reads_from_its_record(redis_url, conn, prefix):
    """A request followed after its log's grace: the whole output, from one record."""
    from lorapool.worker import Worker, WorkerConfig

    bench = load()
    jobs = [(f"c{i}", 3 + i) for i in range(4)]

    async def submit_then_read(ids):
        producer = AsyncProducer(redis_url, prefix=prefix)
        if ids is None:
            handles = await producer.submit_many(
                [{"prompt_token_ids": [1, 2]}] * len(jobs),
                [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in jobs],
                request_ids=[rid for rid, _ in jobs],
            )
            await producer.aclose()
            return [h.request_id for h in handles]
        outs = [await (await producer.handle(rid)).result(timeout=10) for rid in ids]
        chunks = [c async for c in (await producer.handle(ids[0])).chunks(timeout=10)]
        await producer.aclose()
        return outs, chunks

    ids = asyncio.run(submit_then_read(None))
    config = WorkerConfig(prefix=prefix, burst=True, audit_key=bench.AUDIT_KEY.encode())
    Worker(bench.StandInEngine(8, 0.0), conn, config, bench.BASE_MODEL).run()
    for rid in ids:
        conn.delete(f"{prefix}:out:{{{rid}}}")  # the grace is over
    outs, chunks = asyncio.run(submit_then_read(ids))
    for (rid, n), out in zip(jobs, outs):
        assert out.finished and out.outputs[0].token_ids == [
            bench.token_of(rid, k) for k in range(n)
        ]
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].offset == 0
