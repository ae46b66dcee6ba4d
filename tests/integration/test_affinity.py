"""Adapter affinity (worker/intake.py) on the real Redis: two real Workers in this
process, stepped by hand so that each move is seen, around the benchmark's
adapter-slot stand-in (benchmarks/pool_sharing.py: ``SlotEngine``).

The policy's bounds are what is tested: an entry goes only to a live peer that
shows its adapter loaded (or is its home) and is not much busier; it moves at most
once; its delivery count stays; a peer that dies holding it gives it up to failover
after the lease, and the request still ends exactly once.
"""

import importlib.util
import time

import orjson
import pytest
from pool_layout import entries, length
from pool_layout import pending as pending_total
from standin import BENCH

from lorapool.protocol import SamplingParams
from lorapool.records.job import DATA
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.intake import AFFINITY_SLACK

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
PROMPT = {"prompt_token_ids": [1, 2, 3]}


def sharing():
    path = BENCH.parent / "pool_sharing.py"
    spec = importlib.util.spec_from_file_location("lorapool_bench_pool_sharing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def pool(conn, keys, producer):
    bench = sharing()
    for i, name in enumerate(("hot", "cold"), start=1):
        path = f"/adapters/{name}"
        info = {"path": path, "sha256": f"{i:064x}", "rank": 8, "alpha": 16.0}
        producer.registry.add(name, path, i, {**info, "target_modules": []})

    def worker(name, loaded=(), lease_s=10.0):
        engine = bench.SlotEngine(8, 0.0, max_loras=2, load_s=0.0)
        for adapter in loaded:
            engine.slots[adapter] = None
        config = WorkerConfig(
            prefix=keys.prefix,
            shards=keys.shards,
            name=name,
            audit_key=bench.AUDIT_KEY.encode(),
            lease_s=lease_s,
        )
        w = Worker(engine, conn, config, bench.BASE_MODEL)
        w.ensure_group()
        made.append(w)
        return w

    made = []
    yield worker
    for w in made:  # what their senders still hold lands before the prefix's clean-up
        try:
            w.publisher.flush(wait=True)
        finally:
            w.publisher.close()  # its sender thread ends even where a send failed


def see_each_other(*workers):
    for w in workers:
        w.heartbeat()
    for w in workers:
        w.heartbeat()  # now every one has seen every other's record


def pending(conn, keys, request_id):
    """(consumer, times delivered) of the request's entry."""
    entry = conn.hget(keys.job(request_id), "entry").decode()
    stream = keys.for_request(request_id).requests
    info = conn.xpending_range(stream, "workers", entry, entry, 1)
    return (info[0]["consumer"].decode(), info[0]["times_delivered"]) if info else None


def run_until_done(conn, keys, workers, count, timeout=30):
    deadline = time.monotonic() + timeout
    while length(conn, keys, "audit") < count:
        assert time.monotonic() < deadline, "requests did not finish"
        for w in workers:
            w.run_once()
    for w in workers:
        w.publisher.flush(wait=True)


def audit_workers(conn, keys) -> dict[str, str]:
    records = [orjson.loads(f[DATA.encode()]) for _, f in entries(conn, keys, "audit")]
    return {r["request_id"]: r["worker"] for r in records}


def test_an_entry_goes_to_the_peer_that_holds_its_adapter_once(conn, producer, pool):
    a, b = pool("a"), pool("b", loaded=["hot"])
    see_each_other(a, b)
    keys = producer.keys
    producer.submit(PROMPT, SamplingParams(max_tokens=4), "hot", request_id="r1")

    a.run_once()  # reads r1, lacks "hot", hands it to b
    assert a.intake.handed_total == 1 and "r1" not in a.held
    assert pending(conn, keys, "r1") == (b.consumer, 1)  # moved; delivered once still
    b.run_once()  # takes it first, though b never read the stream
    assert "r1" in b.held
    # b lacks nothing here, and a handed entry never moves again
    assert b.intake.handed_total == 0
    run_until_done(conn, keys, [a, b], 1)
    assert audit_workers(conn, keys) == {"r1": "b"}
    assert pending_total(conn, keys) == 0
    assert sum(conn.llen(view.handoff(b.consumer)) for view in keys.shard_views) == 0


def test_a_new_adapter_goes_to_its_home_and_stays_there(conn, producer, pool):
    """Neither holds "cold": both send it to the same worker (its rendezvous home), so
    it loads once, not on both."""
    a, b = pool("a"), pool("b")
    see_each_other(a, b)
    home = a.intake.home("cold")  # a worker's consumer: its name and incarnation
    assert home == b.intake.home("cold")
    home = {a.consumer: "a", b.consumer: "b"}[home]
    keys = producer.keys
    ids = [f"c{i}" for i in range(4)]
    producer.submit_many([PROMPT] * 4, SamplingParams(max_tokens=2), "cold", request_ids=ids)
    run_until_done(conn, keys, [a, b], 4)
    assert set(audit_workers(conn, keys).values()) == {home}
    loads = {w.name: w.engine.loads for w in (a, b)}
    assert loads == {home: 1, ({"a", "b"} - {home}).pop(): 0}


def test_a_busier_peer_is_not_handed_work(conn, producer, pool):
    a, b = pool("a"), pool("b", loaded=["hot"])
    # b is busy: more requests than a by over the slack (base-model ones, read by b)
    busy = [f"busy{i}" for i in range(AFFINITY_SLACK + 2)]
    producer.submit_many([PROMPT] * len(busy), SamplingParams(max_tokens=50), None, busy)
    b.run_once()
    assert len(b.held) == len(busy)
    # b's step started a round trip in its sender's thread that reads for its free
    # slots too: done before r1 comes (on a loaded machine it could reach Redis after
    # r1 and read it, b's own read, not a handoff)
    b.publisher.flush(wait=True)
    see_each_other(a, b)
    producer.submit(PROMPT, SamplingParams(max_tokens=2), "hot", request_id="r1")
    a.run_once()  # a takes r1 itself
    assert a.intake.handed_total == 0 and "r1" in a.held
    assert pending(conn, producer.keys, "r1") == (a.consumer, 1)


def test_a_peer_that_dies_holding_a_handed_entry_gives_it_up_after_the_lease(conn, producer, pool):
    lease_s = 0.5
    a, b = pool("a", lease_s=lease_s), pool("b", loaded=["hot"], lease_s=lease_s)
    see_each_other(a, b)
    keys = producer.keys
    producer.submit(PROMPT, SamplingParams(max_tokens=3), "hot", request_id="r1")
    a.run_once()
    assert pending(conn, keys, "r1") == (b.consumer, 1)
    # b dies before its next read; a goes on alone and claims it after the lease
    conn.delete(keys.alive(b.consumer))
    handed_at = time.monotonic()
    deadline = handed_at + 10 * lease_s
    while "r1" not in a.held:
        assert time.monotonic() < deadline, "the handed entry was never claimed"
        a.run_once()
    assert time.monotonic() - handed_at >= lease_s
    assert pending(conn, keys, "r1") == (a.consumer, 2)
    run_until_done(conn, keys, [a], 1)
    assert audit_workers(conn, keys) == {"r1": "a"}


def settle(worker):
    """One iteration, then every round trip it started done and applied (a busy worker
    reads in its sender's trip and starts what it read at the next flush)."""
    worker.run_once()
    worker.publisher.flush(wait=True)
    worker.publisher.flush(wait=True)


def test_garbage_in_a_handoff_list_is_passed_over(conn, producer, pool):
    """Anything pushed onto a worker's handoff list that is not an entry it owns (bad
    shapes, another worker's entry, an unknown id, NUL bytes) is skipped; a real handoff
    behind it still arrives, and the other worker's entry stays with its owner."""
    a, b = pool("a"), pool("b", loaded=["hot"])
    keys = producer.keys
    producer.submit(PROMPT, SamplingParams(max_tokens=20), None, request_id="theirs")
    settle(a)  # a holds "theirs"
    theirs = conn.hget(keys.job("theirs"), "entry").decode()
    junk = ["", "x", "1", "0 " + theirs, "3 " + theirs, "1 " + theirs, "1 9-9", "2 \x00", "1 -"]
    conn.rpush(keys.for_request("r1").handoff(b.consumer), *junk)  # where r1 will be handed
    see_each_other(a, b)
    producer.submit(PROMPT, SamplingParams(max_tokens=2), "hot", request_id="r1")
    settle(a)  # hands r1 to b, behind the junk
    assert pending(conn, keys, "r1") == (b.consumer, 1)
    settle(b)
    assert set(b.held) == {"r1"}
    assert pending(conn, keys, "theirs") == (a.consumer, 1)
    run_until_done(conn, keys, [a, b], 2)
    assert audit_workers(conn, keys) == {"theirs": "a", "r1": "b"}


def test_a_full_peer_takes_what_it_was_handed_at_its_next_step(conn, producer, pool):
    """Handed entries do not wait for a free slot: the peer adds them at its next round
    trip (they wait in its engine), which bounds how long a handed entry waits."""
    a, b = pool("a"), pool("b", loaded=["hot"])
    keys = producer.keys
    long = SamplingParams(max_tokens=200)
    producer.submit_many([PROMPT] * 8, long, "hot", [f"hot{i}" for i in range(8)])
    settle(b)
    assert len(b.held) == 8 and b.engine.capacity() == 0  # b is full
    see_each_other(a, b)  # a sees b's 8 (over AFFINITY_SLACK above its 0: it keeps "cold")
    producer.submit_many([PROMPT] * 6, long, "cold", [f"cold{i}" for i in range(6)])
    settle(a)
    assert len(a.held) == 6  # a is busy too, within AFFINITY_SLACK of b
    see_each_other(a, b)
    producer.submit(PROMPT, SamplingParams(max_tokens=2), "hot", request_id="r1")
    settle(a)
    assert pending(conn, keys, "r1") == (b.consumer, 1)
    settle(b)  # still full, but its step's round trip takes the handed entry
    assert "r1" in b.held and b.engine.request_counts()[1] >= 1  # waiting in its engine
