"""The worker's time between engine steps while the engine has free slots.

A real ``Worker`` (in this process, on a thread) around the queue bench's engine
stand-in (``standin_engine.py``: each step a sleep of ``--step-ms``, as a GPU leaves the
CPU free) with ``--slots`` slots runs ``--running`` long jobs, so that every step has
free slots and nothing new comes: what the worker does between two steps (hand the
step's chunks to the sender, upkeep, and, where it costs at most 10% of the step, one
READ a shard of new entries for the free slots: ``Intake.between_steps``) is the gap
from one step's end to the next one's start, as the stand-in records them. Reported
per layout: the gaps' mean, p50 and p99 (ms) and steps a second, over the steps from
1 s after the first to the end. Base against head: alternate runs of two trees.

    python benchmarks/busy_gaps.py [--step-ms 5] [--seconds 6] [--running 64]
        [--redis-url redis://127.0.0.1:6379/0] [--cluster-url redis+cluster://...:7000/0]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from standin_engine import AUDIT_KEY, BASE_MODEL, StandInEngine  # noqa: E402


def run(url: str, shards: int, args) -> dict:
    from lorapool.connection import connect
    from lorapool.producer import Producer
    from lorapool.protocol import SamplingParams
    from lorapool.worker import Worker, WorkerConfig

    prefix = f"bench-gaps-{uuid.uuid4().hex[:8]}"
    conn = connect(url)
    engine = StandInEngine(args.slots, args.step_ms / 1e3)
    config = WorkerConfig(prefix=prefix, shards=shards, name="gaps", audit_key=AUDIT_KEY.encode())
    worker = Worker(engine, conn, config, BASE_MODEL)
    worker.ensure_group()
    producer = Producer(conn, prefix=prefix, shards=shards)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    producer.submit_many([{"prompt_token_ids": [1]}] * args.running, params)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        time.sleep(args.seconds)
    finally:
        worker.on_signal()  # drain, then hand back at once: as a second SIGTERM
        worker.on_signal()
        thread.join(timeout=30)
        for key in conn.scan_iter(match=f"{prefix}*", count=1000):
            conn.delete(key)
        for key in conn.scan_iter(match=f"{{{prefix}*", count=1000):
            conn.delete(key)
    steps = [s for s in engine.steps if s[0] >= engine.steps[0][0] + 1.0]
    gaps = sorted(1e3 * (b[0] - a[1]) for a, b in zip(steps, steps[1:]))
    span = steps[-1][1] - steps[0][0]
    return {
        "steps": len(steps),
        "gap_ms_mean": round(statistics.fmean(gaps), 3),
        "gap_ms_p50": round(gaps[len(gaps) // 2], 3),
        "gap_ms_p99": round(gaps[int(len(gaps) * 0.99)], 3),
        "steps_per_s": round(len(steps) / span, 1),
        "running": max(s[3] for s in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--cluster-url", default=None, help="also a Redis Cluster, 3 shards")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = {"step_ms": args.step_ms, "running": args.running, "slots": args.slots}
    result["standalone"] = run(args.redis_url, 1, args)
    if args.cluster_url:
        result["cluster"] = run(args.cluster_url, 3, args)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
