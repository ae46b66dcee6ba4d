"""A single JobHandle: the chunk log (a list, a chunk at index seq) for exactness, the
request's live channel (``Listener``) for speed.

The oracle of the first test is the benchmark stand-in's output, a fixed function of
(request id, position), streamed by a real Worker process; the others write the log
and the channel by hand, as the worker's APPEND does, dropping publishes as a broken
Pub/Sub connection would.
"""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from standin import load

from lorapool.lifecycle.chunk_log import LogCompacted, encode_result
from lorapool.producer.client import JobHandle
from lorapool.protocol import SamplingParams
from lorapool.records.chunk import Chunk, Delta, encode_chunk

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
WORKER = Path(__file__).resolve().parents[1] / "support" / "standin_worker.py"


def test_handles_stream_live_and_exact(pool_url, keys, producer, tmp_path):
    bench = load()
    cmd = [sys.executable, str(WORKER), pool_url, keys.prefix, str(keys.shards), "lw", "16", "5"]
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen(cmd, stderr=log)
    jobs = [(f"live-{i}", 150 + 10 * i) for i in range(8)]
    try:
        handles = producer.submit_many(
            [{"prompt_token_ids": [1, 2]}] * len(jobs),
            [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in jobs],
            request_ids=[rid for rid, _ in jobs],
        )
        got: dict[str, list] = {}

        def read(handle):
            got[handle.request_id] = [
                (chunk, time.monotonic()) for chunk in handle.chunks(timeout=120)
            ]

        threads = [threading.Thread(target=read, args=(h,)) for h in handles]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
    finally:
        worker.terminate()
        worker.wait(30)
    for rid, n in jobs:
        chunks = [chunk for chunk, _ in got[rid]]
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished
        tokens = [t for c in chunks for o in c.outputs for t in o.token_ids]
        assert tokens == [bench.token_of(rid, k) for k in range(n)]
        # live: chunks came as they were made (~1 s of 5 ms steps), not in a read of the
        # log a second (the quiet interval) apart
        moments = {round(at, 2) for _, at in got[rid]}
        assert len(moments) >= 20, f"{rid}: chunks arrived at only {len(moments)} moments"


def _chunk(rid: str, seq: int, final: bool = False) -> Chunk:
    out = Delta(text=f" t{seq}", token_ids=[seq], finish_reason="length" if final else None)
    return Chunk(request_id=rid, seq=seq, offset=seq, outputs=[out], finished=final)


class _Writer:
    """Appends and publishes as the worker's APPEND does, or appends without publishing
    (a publish the reader's connection lost)."""

    def __init__(self, conn, keys, rid):
        self.conn, self.key = conn, keys.out(rid)
        self.publish = conn.spublish if keys.shards else conn.publish
        self.rid = rid

    def append(self, seq: int, final: bool = False, publish: bool = True) -> None:
        payload = encode_chunk(_chunk(self.rid, seq, final))
        self.conn.rpush(self.key, payload)
        if publish:
            self.publish(self.key, payload)


def _read_in_thread(handle, after=-1):
    got, done = [], threading.Event()

    def read():
        try:
            got.extend(handle.chunks(after=after, timeout=30))
        finally:
            done.set()

    threading.Thread(target=read, daemon=True).start()
    return got, done


def _wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_lost_publish_is_read_from_the_log(conn, keys, producer):
    rid = "lost"
    writer = _Writer(conn, keys, rid)
    writer.append(0, publish=False)  # before the reader: from the log
    got, done = _read_in_thread(JobHandle(producer, rid))
    _wait_for(lambda: len(got) == 1)
    time.sleep(0.2)  # subscribed by now (it confirms before reading the log again)
    writer.append(1)
    _wait_for(lambda: len(got) == 2)
    writer.append(2, publish=False)  # lost on the way
    start = time.monotonic()
    writer.append(3)  # past a gap: the reader reads 2 and 3 from the log at once
    _wait_for(lambda: len(got) == 4)
    assert time.monotonic() - start < 0.5
    writer.append(4, final=True, publish=False)  # the final one lost: a quiet second
    assert done.wait(5)
    assert [c.seq for c in got] == [0, 1, 2, 3, 4] and got[-1].finished
    assert [c.outputs[0].token_ids for c in got] == [[0], [1], [2], [3], [4]]


def test_a_finished_request_reads_without_subscribing(conn, keys, producer):
    rid = "done"
    writer = _Writer(conn, keys, rid)
    for seq in range(3):
        writer.append(seq, final=seq == 2, publish=False)
    channels_before = _channels(conn)
    chunks = list(JobHandle(producer, rid).chunks(timeout=5))
    assert [c.seq for c in chunks] == [0, 1, 2] and _channels(conn) == channels_before
    # compacted: the log gone, the record in the run key: a reader from the start
    # gets the whole output as one chunk; one from midway cannot tell where the rest
    # begins (its offsets unknown) and says so
    out = Delta(text=" t0 t1 t2", token_ids=[0, 1, 2])
    conn.delete(keys.out(rid))
    conn.hset(
        keys.run(rid),
        "result",
        encode_result(Chunk(request_id=rid, seq=2, outputs=[out], finished=True)),
    )
    (whole,) = JobHandle(producer, rid).chunks(timeout=5)
    assert whole.outputs[0].token_ids == [0, 1, 2] and whole.finished
    with pytest.raises(LogCompacted):
        list(JobHandle(producer, rid).chunks(after=0, timeout=5))
    assert _channels(conn) == channels_before


def test_a_reader_that_stops_early_unsubscribes(conn, keys, producer):
    rid = "early"
    writer = _Writer(conn, keys, rid)
    writer.append(0)
    chunks = JobHandle(producer, rid).chunks(timeout=5)
    assert next(chunks).seq == 0  # from the log, before any subscription
    second = []
    thread = threading.Thread(target=lambda: second.append(next(chunks)))
    thread.start()  # subscribes, reads the log again, waits on the channel
    _wait_for(lambda: keys.out(rid).encode() in _channels(conn))
    writer.append(1)
    thread.join(5)
    assert [c.seq for c in second] == [1]
    chunks.close()  # the consumer breaks out of its loop
    _wait_for(lambda: keys.out(rid).encode() not in _channels(conn))


def _channels(conn) -> set:
    """Channels with a subscriber, on every node of a cluster."""
    import redis

    if isinstance(conn, redis.RedisCluster):
        replies = conn.pubsub_shardchannels(target_nodes=redis.RedisCluster.PRIMARIES)
        replies = replies.values() if isinstance(replies, dict) else [replies]
        return {c for reply in replies for c in reply}
    return set(conn.pubsub_channels())
