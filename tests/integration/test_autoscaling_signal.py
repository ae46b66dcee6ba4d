"""The autoscaling signal: KEDA's redis-streams scaler (lag mode) read against the real Redis.

``keda_lag`` follows what KEDA's scaler does (kedacore/keda,
pkg/scalers/redis_streams_scaler.go, read at 8b4f083, 2026-08): it needs Redis 7+
(INFO's redis_version), answers 0 when the stream does not exist, the group's
``lag`` from XINFO GROUPS when the group exists, and XLEN when it does not; the
scaler is active when that count is above ``activationLagCount`` (default 0), and
the HPA it feeds wants ``ceil(count / lagCount)`` replicas (an AverageValue target).
Where Redis answers a nil lag (unknown), KEDA's client reads it as 0: a backlog
would look empty, so lorapool must never make the lag unknown.

On a Redis Cluster a pool has a job stream per shard, and a KEDA trigger reads one
stream: one trigger per shard (deploy/README.md), each checked here on its own.
"""

import math
import time
from collections import Counter
from pathlib import Path

import keda
import pytest
import yaml
from pool_layout import length

from lorapool.connection import ensure_group
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.serve import base_model_info

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
UNKNOWN = "unknown"  # a nil lag: KEDA would read 0
KEDA_YAML = (
    Path(__file__).resolve().parents[2] / "deploy" / "autoscale" / "keda" / "autoscale-keda.yaml"
)


def keda_lag(conn, stream: str, group: str):
    """The count KEDA's lag mode reads, or UNKNOWN where Redis answers nil."""
    major = int(conn.info("server")["redis_version"].split(".")[0])
    assert major >= 7, "KEDA's lag mode needs Redis 7+"
    if not conn.exists(stream):
        return 0
    for info in conn.xinfo_groups(stream):
        if info["name"].decode() == group:
            return UNKNOWN if info["lag"] is None else info["lag"]
    return conn.xlen(stream)


def keda_active(count: int, activation_lag_count: int = 0) -> bool:
    return count > activation_lag_count


def keda_replicas(count: int, lag_count: int) -> int:
    return math.ceil(count / lag_count)


def streams_of(keys) -> list[str]:
    """The job streams KEDA's triggers read: one, or one per shard."""
    return [view.requests for view in keys.shard_views]


def ids_on_one_shard(keys, count: int) -> list[str]:
    ids = (f"r{i}" for i in range(10_000))
    return [r for r in ids if keys.shard_of(r) == 0][:count]


def test_five_jobs_without_workers_read_five_and_activate(conn, producer):
    keys = producer.keys
    streams = streams_of(keys)
    assert [keda_lag(conn, s, WORKERS_GROUP) for s in streams] == [0] * len(streams)
    ids = [f"r{i}" for i in range(5)]
    producer.submit_many([f"job {i}" for i in range(5)], SamplingParams(max_tokens=4), None, ids)
    on = Counter(keys.for_request(r).requests for r in ids)
    # each trigger reads its shard's jobs: XLEN, or the group's lag
    assert [keda_lag(conn, s, WORKERS_GROUP) for s in streams] == [on[s] for s in streams]
    for stream in streams:
        ensure_group(conn, stream, WORKERS_GROUP)  # as the first worker does
    counts = [keda_lag(conn, s, WORKERS_GROUP) for s in streams]
    assert counts == [on[s] for s in streams] and any(keda_active(c) for c in counts)
    # KEDA scales to its largest trigger: with lagCount one worker's capacity over the
    # shard count, never fewer workers than the pool's whole lag asks for
    lag_count = 4
    per_shard = lag_count // len(streams) or 1
    wanted = max(keda_replicas(c, per_shard) for c in counts)
    assert wanted >= keda_replicas(sum(counts), lag_count) == 2


def test_deleting_an_undelivered_entry_makes_the_lag_unknown(conn, producer):
    """The negative control: what lorapool must never do."""
    ids = ids_on_one_shard(producer.keys, 5)
    stream = producer.keys.for_request(ids[0]).requests
    ensure_group(conn, stream, WORKERS_GROUP)
    producer.submit_many([f"job {i}" for i in range(5)], SamplingParams(max_tokens=4), None, ids)
    conn.xreadgroup(WORKERS_GROUP, "c1", {stream: ">"}, count=2)
    conn.xdel(stream, conn.xrange(stream)[3][0])
    assert keda_lag(conn, stream, WORKERS_GROUP) == UNKNOWN


@pytest.fixture(scope="module")
def engines(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    args = EngineArgs(model=model, max_num_seqs=3, max_num_batched_tokens=512)
    return LLMEngine.from_engine_args(args), LLMEngine.from_engine_args(args)


def _worker(engine, conn, keys, model, name):
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, name=name, lease_s=1, block_ms=10)
    worker = Worker(engine, conn, config, base_model_info(model))
    worker.ensure_group()
    return worker


# Found by this test: the worker's APPEND script used to XDEL a request's entry when it
# finished. Redis 7 reports the group's lag as nil while the most recently delivered
# entry is deleted and an earlier delivered one is still in the stream (a short request
# finishing before a long one taken before it), and KEDA reads that nil as 0. APPEND now
# trims the stream from its head (XTRIM MINID up to the oldest pending entry), which
# keeps the lag known.
def test_lag_is_never_unknown_through_aborts_dead_letters_and_a_failover(
    engines, conn, keys, producer, model
):
    streams = streams_of(keys)
    seen = []

    def step(worker, times=1):
        for _ in range(times):
            worker.run_once()
            seen.extend(keda_lag(conn, s, WORKERS_GROUP) for s in streams)

    first, spare = (_worker(e, conn, keys, model, n) for e, n in zip(engines, "ab"))
    lengths = [30, 4, 12, 4, 20, 6, 8, 4, 16, 4]
    handles = [
        producer.submit(f"job {i}", SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for i, n in enumerate(lengths)
    ]
    conn.xadd(streams[0], {"data": b"{not json"})  # dead-lettered by whoever reads it
    step(first, 6)
    handles[0].abort()
    step(first, 6)
    assert first.held  # the first worker "dies" holding entries: no teardown
    deadline = time.monotonic() + 60
    # until every job ended and the malformed entry was read (on a loaded machine the
    # jobs of the other shards could all end before a read reached it)
    while not all(h.status() in ("finished", "failed") for h in handles) or not length(
        conn, keys, "dead"
    ):
        assert time.monotonic() < deadline
        step(spare)
        time.sleep(0.01)
    assert length(conn, keys, "dead") == 1
    assert handles[0].result(timeout=5).outputs[0].finish_reason == "abort"
    assert UNKNOWN not in seen, f"lag unknown at {seen.count(UNKNOWN)} of {len(seen)} reads"
    assert seen[-len(streams) :] == [0] * len(streams)


# --- KEDA's loop on the ScaledObject of deploy/autoscale/keda/autoscale-keda.yaml ---------

CAPACITY = 3  # the engines' max_num_seqs: the manifest's targets are one worker's capacity


def scaled_object(capacity: int) -> dict:
    """deploy/autoscale/keda/autoscale-keda.yaml's ScaledObject with its targets (one worker's
    --max-num-seqs there) set to the test workers' capacity."""
    (scaled,) = [
        d for d in yaml.safe_load_all(KEDA_YAML.read_text()) if d["kind"] == "ScaledObject"
    ]
    for trigger in scaled["spec"]["triggers"]:
        meta = trigger["metadata"]
        for key in ("lagCount", "pendingEntriesCount", "streamLength"):
            if key in meta:
                meta[key] = str(capacity)
    modifiers = scaled["spec"].get("advanced", {}).get("scalingModifiers")
    if modifiers:
        modifiers["target"] = str(capacity)
    return scaled


def test_keda_holds_busy_workers_under_steady_load_and_scales_to_zero_only_when_idle(
    engines, conn, keys, producer, model
):
    """Two workers kept busy (2 x CAPACITY jobs in the pool at every poll, each taken at
    once: the lag is about 0) must stay two, poll after poll past the cooldown; once the
    last job ended KEDA waits the cooldown, then scales to zero."""
    workers = [_worker(e, conn, keys, model, n) for e, n in zip(engines, "ab")]
    loop = keda.Loop(scaled_object(CAPACITY))

    def streams_of(stream: str) -> list[str]:  # one trigger per shard: summed
        batch = stream.endswith(":batch")
        return [v.batch_requests if batch else v.requests for v in keys.shard_views]

    def poll() -> int:
        return loop.poll(lambda trigger: conn, streams_of)

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    running: list = []

    def top_up() -> None:
        running[:] = [h for h in running if h.status() not in ("finished", "failed")]
        while len(running) < 2 * CAPACITY:
            running.append(producer.submit(f"job {len(running)}", params))

    top_up()
    assert poll() == 2  # from zero: queued work wakes the pool
    for _ in range(2 * loop.cooldown // loop.interval):  # steady load, twice the cooldown
        for _ in range(3):
            for worker in workers:
                worker.run_once()
        for worker in workers:  # no final chunk (and its ack) lands between top_up and poll
            worker.publisher.flush(wait=True)
        top_up()
        assert poll() == 2, f"busy workers scaled to {loop.replicas} at t={loop.now}s"
    deadline = time.monotonic() + 60
    while True:  # the load stops: the last jobs run to their end
        assert time.monotonic() < deadline
        for worker in workers:
            worker.run_once()
        running[:] = [h for h in running if h.status() not in ("finished", "failed")]
        if not running:
            break
        assert poll() >= 1
    idle_polls = 0
    while poll() > 0:
        idle_polls += 1
        assert idle_polls < loop.cooldown // loop.interval
    # zero exactly one cooldown after the last poll that saw work, not before (that poll
    # may be the first after the drain: the last jobs' acks still on their way)
    assert loop.now - loop.last_active == loop.cooldown
