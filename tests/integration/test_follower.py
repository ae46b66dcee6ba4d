"""The multiplexed reader: one connection follows hundreds of live requests exactly.

A real Worker around the benchmark's stand-in engine (a process, 5 ms steps) streams
them; the oracle is the stand-in's output, a fixed function of (request id,
position). The follower's Pub/Sub connection is cut mid-run: what was published
meanwhile comes from the logs, so every stream is still exact.
"""

import asyncio
import functools
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from standin import load

from lorapool.producer import AsyncProducer
from lorapool.protocol import SamplingParams

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
WORKER = Path(__file__).resolve().parents[1] / "support" / "standin_worker.py"
REQUESTS = 200


def start_worker(url, keys, tmp_path):
    """A worker process: 64 sequences, 5 ms steps (``standin_worker``)."""
    cmd = [sys.executable, str(WORKER), url, keys.prefix, str(keys.shards), "follow-w", "64", "5"]
    with open(tmp_path / "worker.log", "w") as log:
        return subprocess.Popen(cmd, stderr=log)


async def follow_all(url, keys, jobs, cut_after_s, release=None):
    """``release``: called once the follower has every stream subscribed (the worker
    is held until then: on a loaded machine it once finished all 200 requests before
    the subscriptions, so no chunk came over the channel and the test proved nothing)."""
    producer = AsyncProducer(url, prefix=keys.prefix, shards=keys.shards)
    handles = await producer.submit_many(
        [{"prompt_token_ids": [1, 2, 3]}] * len(jobs),
        [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in jobs],
        request_ids=[rid for rid, _ in jobs],
    )

    async def read(handle):
        return [chunk async for chunk in handle.chunks(timeout=120)]

    async def cut():
        if release is not None:
            deadline = time.monotonic() + 30
            while not _all_subscribed(producer.follower, len(jobs)):
                assert time.monotonic() < deadline, "the follower did not subscribe"
                await asyncio.sleep(0.01)
            release()
        # mid-stream: once the channel has delivered (on a loaded machine the cluster's
        # 200 SSUBSCRIBEs, one a channel, can outlast a fixed delay)
        await asyncio.sleep(cut_after_s)
        deadline = time.monotonic() + 20
        while not producer.follower.num_live:
            assert time.monotonic() < deadline, "no chunk came over the channel"
            await asyncio.sleep(0.01)
        pubsub = producer.follower.pubsub  # on a cluster: one per node (SSUBSCRIBE)
        nodes = getattr(pubsub, "node_pubsub_mapping", None)
        assert nodes or not keys.shards
        for each in nodes.values() if nodes else [pubsub]:
            await each.connection.disconnect()  # in-flight messages lost

    reads = asyncio.gather(*(read(h) for h in handles))
    _, logs = await asyncio.gather(cut(), reads)
    follower = producer.follower
    await producer.aclose()
    return logs, follower


def _all_subscribed(follower, count: int) -> bool:
    """Whether the follower follows ``count`` channels, each confirmed by Redis."""
    followed = [f for readers in follower.followed.values() for f in readers]
    return len(followed) == count and all(f.subscribed.is_set() for f in followed)


def test_one_connection_follows_every_stream_exactly(pool_url, conn, keys, tmp_path):
    bench = load()
    jobs = [(f"f{i}", 4 + (i * 7) % 60) for i in range(REQUESTS)]
    worker = start_worker(pool_url, keys, tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not conn.hlen(keys.workers):
            assert worker.poll() is None and time.monotonic() < deadline, "worker did not start"
            time.sleep(0.05)
        worker.send_signal(signal.SIGSTOP)
        release = functools.partial(worker.send_signal, signal.SIGCONT)
        logs, follower = asyncio.run(follow_all(pool_url, keys, jobs, 0.5, release))
    finally:
        worker.send_signal(signal.SIGCONT)
        worker.terminate()
        worker.wait(30)
    for (rid, n), log in zip(jobs, logs):
        assert [c.seq for c in log] == sorted({c.seq for c in log})  # in order, no repeat
        assert [c.finished for c in log].count(True) == 1 and log[-1].finished
        tokens = [t for c in log for o in c.outputs for t in o.token_ids]
        assert tokens == [bench.token_of(rid, k) for k in range(n)], rid
    total = sum(len(log) for log in logs)
    assert follower.num_live + follower.num_filled == total
    # both ways were taken: the channel, and the logs for what the cut lost
    assert follower.num_live > 0 and follower.num_filled > 0


def test_a_compacted_log_reads_from_its_record(pool_url, conn, keys):
    """A request followed after its log's grace: the whole output, from one record."""
    from lorapool.worker import Worker, WorkerConfig

    bench = load()
    jobs = [(f"c{i}", 3 + i) for i in range(4)]

    async def submit_then_read(ids):
        producer = AsyncProducer(pool_url, prefix=keys.prefix, shards=keys.shards)
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
    key = bench.AUDIT_KEY.encode()
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True, audit_key=key)
    Worker(bench.StandInEngine(8, 0.0), conn, config, bench.BASE_MODEL).run()
    for rid in ids:
        assert conn.delete(keys.out(rid)) == 1  # the grace is over
    outs, chunks = asyncio.run(submit_then_read(ids))
    for (rid, n), out in zip(jobs, outs):
        assert out.finished and out.outputs[0].token_ids == [
            bench.token_of(rid, k) for k in range(n)
        ]
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].offset == 0


def test_a_new_client_follows_before_any_other_command(pool_url, keys, producer, caplog):
    """A fresh AsyncProducer whose first call is a follow subscribes (confirmed) and
    reads the output: on a cluster the follower's SSUBSCRIBE routes by slots its client
    had not learned yet (redis-py raised SlotNotCoveredError in the listener, and the
    reader fell back to polling the log) until the follower initializes the client."""
    served_then_followed_fresh(pool_url, keys, producer, "n1")
    assert "no subscribe confirmation" not in caplog.text


def served_then_followed_fresh(pool_url, keys, producer, rid: str) -> None:
    """``rid`` (5 tokens) served by a stand-in worker, then followed by a fresh
    AsyncProducer whose first call is the follow: every token, once, to the final."""
    from lorapool.producer.aio import AsyncJobHandle
    from lorapool.worker import Worker, WorkerConfig

    bench = load()
    producer.submit({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=5), request_id=rid)
    key = bench.AUDIT_KEY.encode()
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True, audit_key=key)
    Worker(bench.StandInEngine(8, 0.0), producer.redis, config, bench.BASE_MODEL).run()

    async def follow():
        fresh = AsyncProducer(pool_url, prefix=keys.prefix, shards=keys.shards)
        try:
            handle = AsyncJobHandle(fresh, rid, "delta")
            return [chunk async for chunk in handle.chunks(timeout=10)]
        finally:
            await fresh.aclose()

    chunks = asyncio.run(follow())
    tokens = [t for c in chunks for o in c.outputs for t in o.token_ids]
    assert tokens == [bench.token_of(rid, k) for k in range(5)] and chunks[-1].finished


@pytest.mark.layouts("standalone")
def test_a_cluster_moving_its_slots_does_not_stop_the_follower(pool_url, keys, producer, caplog):
    """SlotNotCoveredError (a cluster between slot maps; not a RedisError, so it used to
    end the listener's task unseen, leaving readers to their slow log polls) is waited
    out like a lost connection: the listener resubscribes and the stream goes on live.
    (Injected into the Pub/Sub read: a real cluster shows it only mid-resharding.)"""
    import redis

    bench = load()
    rid = "moving"
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    producer.submit({"prompt_token_ids": [1]}, params, request_id=rid)
    cmd = [sys.executable, str(WORKER), pool_url, keys.prefix, "0", "mv", "8", "20"]
    worker = subprocess.Popen(cmd)

    async def follow():
        fresh = AsyncProducer(pool_url, prefix=keys.prefix)
        handle = await fresh.handle(rid)
        chunks = []
        try:
            async for chunk in handle.chunks(timeout=60):
                chunks.append(chunk)
                if len(chunks) == 1:  # the listener's next read fails, once
                    pubsub = fresh.follower.pubsub
                    real = pubsub.get_message

                    async def fails_once(*args, pubsub=pubsub, real=real, **kwargs):
                        pubsub.get_message = real
                        raise redis.exceptions.SlotNotCoveredError("slot 1 is not covered")

                    pubsub.get_message = fails_once
            return chunks, fresh.follower.error, fresh.follower.num_live
        finally:
            await fresh.aclose()

    try:
        chunks, error, live = asyncio.run(follow())
    finally:
        worker.terminate()
        worker.wait(30)
    assert error is None and "resubscribing" in caplog.text
    tokens = [t for c in chunks for o in c.outputs for t in o.token_ids]
    assert tokens == [bench.token_of(rid, k) for k in range(200)] and chunks[-1].finished
    # 200 steps of 20 ms: after the fault the listener waits a second (poll_s), the
    # reader's log polls fill it, and the rest comes over the channel again
    assert live > 100


def test_the_process_standing_still_does_not_run_out_the_subscribe_wait(
    pool_url, keys, producer, caplog, monkeypatch
):
    """The process stands still for longer than the follower waits for a subscribe
    confirmation, just after the listener sent the subscribe (a full GC of a big heap:
    ~1 s measured in the test process, every ~20 runs of the test above under load): the
    confirmation, on the socket when the process resumes, is read, and no warning. (The
    wait was wall-clock: it ran out in the same turn, warned, and left the reader to the
    log's polls.)"""
    from lorapool.lifecycle.follower import Follower

    real, stood = Follower._send_subscriptions, []

    async def stand_still_once(self):
        sending = bool(self.to_subscribe)
        await real(self)
        if sending and not stood:
            stood.append(self.poll_s)
            time.sleep(self.poll_s + 0.3)  # blocks the loop, as a collection does

    monkeypatch.setattr(Follower, "_send_subscriptions", stand_still_once)

    served_then_followed_fresh(pool_url, keys, producer, "p1")
    assert stood == [1.0]
    assert "no subscribe confirmation" not in caplog.text


def test_an_idle_follower_waits_without_reading_and_wakes_for_the_next(
    pool_url, keys, producer, caplog, monkeypatch
):
    """Once nothing is followed, the listener sleeps until the next follow asks for a
    subscription: no reads in between, and that subscription goes out at once. (It read
    for 20 ms and slept 20 ms in turn: a light tenant's call, one every 0.1 s, waited
    ~30 ms of its 45 for its subscription; benchmarks/RESULTS.md.) Both follows read
    every token, their subscriptions confirmed."""
    from lorapool.lifecycle.follower import Follower
    from lorapool.producer.aio import AsyncJobHandle
    from lorapool.worker import Worker, WorkerConfig

    bench = load()
    for rid in ("w1", "w2"):
        producer.submit({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=5), request_id=rid)
    key = bench.AUDIT_KEY.encode()
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True, audit_key=key)
    Worker(bench.StandInEngine(8, 0.0), producer.redis, config, bench.BASE_MODEL).run()
    real, rounds = Follower._send_subscriptions, []

    async def counted(self):
        rounds.append(time.monotonic())
        await real(self)

    monkeypatch.setattr(Follower, "_send_subscriptions", counted)

    async def follow_twice():
        fresh = AsyncProducer(pool_url, prefix=keys.prefix, shards=keys.shards)
        try:
            first = [c async for c in AsyncJobHandle(fresh, "w1", "delta").chunks(timeout=10)]
            await asyncio.sleep(0.3)  # its unsubscribe sent and confirmed: nothing followed
            quiet_from = time.monotonic()
            await asyncio.sleep(0.4)
            idle_rounds = [t for t in rounds if t >= quiet_from]
            second = [c async for c in AsyncJobHandle(fresh, "w2", "delta").chunks(timeout=10)]
            return first, second, idle_rounds
        finally:
            await fresh.aclose()

    first, second, idle_rounds = asyncio.run(follow_twice())
    assert idle_rounds == []  # the old listener went round every 40 ms: 10 here
    for rid, chunks in (("w1", first), ("w2", second)):
        tokens = [t for c in chunks for o in c.outputs for t in o.token_ids]
        assert tokens == [bench.token_of(rid, k) for k in range(5)] and chunks[-1].finished
    assert "no subscribe confirmation" not in caplog.text
