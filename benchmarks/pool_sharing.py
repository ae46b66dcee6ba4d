"""Sharing work across a pool: how a burst splits between workers, and adapter loads
with and without adapter affinity (``worker/intake.py``).

Worker processes run the real ``Worker`` around the GPU stand-in of queue_gpu.py,
given adapter slots here (``SlotEngine``: ``--max-loras`` device slots, least
recently used evicted; a request runs only once its adapter is in a slot; each load
is counted and costs ``--load-ms``).

- burst: two idle workers get a burst of ``--burst-size`` short jobs, ``--bursts``
  times; the share each served (each audit record names its worker), with the fair
  share of a burst and without (``--no-fair-share``);
- affinity: ``--requests`` jobs at ``--rate`` per second over ``--adapters`` adapters
  of skewed popularity (rank r weighs 1.5^-r), two workers with ``--max-loras`` slots
  each; adapter loads per 1,000 requests with affinity and without
  (``--no-affinity``), and the entries handed to the peer that held the adapter.

    lorapool bench pool_sharing [--bursts 5] [--requests 1000] [--json out.json]

Redis: ``--redis-url``, else ``$REDIS_URL``, else 127.0.0.1:6379/0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, OrderedDict, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from queue_gpu import AUDIT_KEY, BASE_MODEL, StandInEngine  # noqa: E402

PROMPT = {"prompt_token_ids": [1, 2, 3]}


class SlotEngine(StandInEngine):
    """The stand-in with ``max_loras`` adapter slots: a waiting request whose adapter
    is not in a slot gets one (a load) when a slot is free or holds an adapter no
    running request uses; else it waits, and requests behind it may go first."""

    def __init__(self, max_num_seqs, step_s, max_loras, load_s):
        super().__init__(max_num_seqs, step_s)
        self.max_loras, self.load_s = max_loras, load_s
        self.slots: OrderedDict[str, None] = OrderedDict()
        self.loads = 0

    def _slot_for(self, name: str | None) -> bool:
        if name is None:
            return True
        if name in self.slots:
            self.slots.move_to_end(name)
            return True
        if len(self.slots) >= self.max_loras:
            used = {r.lora.lora_name for r in self.running.values() if r.lora is not None}
            idle = next((n for n in self.slots if n not in used), None)
            if idle is None:
                return False
            del self.slots[idle]
        self.slots[name] = None
        self.loads += 1
        time.sleep(self.load_s)
        return True

    def step(self):
        admitted, held_back = [], deque()
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            request = self.waiting.popleft()
            name = None if request.lora is None else request.lora.lora_name
            (admitted if self._slot_for(name) else held_back).append(request)
        for request in admitted:
            self.running[request.request_id] = request
        outputs = super().step()  # admits nothing more: the waiting ones are put back after
        self.waiting.extendleft(reversed(held_back))
        return outputs

    def lora_state(self):
        return {"device": list(self.slots), "cpu": [], "max_loras": self.max_loras}


def serve_worker(args) -> None:
    """Run the real Worker around a ``SlotEngine`` until SIGTERM; write its stats."""
    from lorapool.connection import connect
    from lorapool.worker import Worker, WorkerConfig

    logging.basicConfig(level=logging.WARNING)
    engine = SlotEngine(args.sequences, args.step_ms / 1000, args.max_loras, args.load_ms / 1000)
    config = WorkerConfig(
        prefix=args.prefix,
        shards=args.shards,
        name=args.name,
        audit_key=AUDIT_KEY.encode(),
        fair_share=not args.no_fair_share,
        affinity=not args.no_affinity,
    )
    worker = Worker(engine, connect(args.redis_url), config, BASE_MODEL)
    worker.run()
    if args.stats:
        stats = {"loads": engine.loads, "handed": worker.intake.handed_total}
        Path(args.stats).write_text(json.dumps(stats))


def start_workers(args, prefix: str, flags: list[str], stats_dir: Path) -> list:
    procs = []
    for name in ("wa", "wb"):
        cmd = [sys.executable, __file__, "--serve-worker", "--redis-url", args.redis_url]
        cmd += ["--prefix", prefix, "--name", name, "--sequences", str(args.sequences)]
        cmd += ["--step-ms", str(args.step_ms), "--max-loras", str(args.max_loras)]
        cmd += ["--load-ms", str(args.load_ms), "--stats", str(stats_dir / f"{name}.json")]
        procs.append(subprocess.Popen(cmd + flags))
    return procs


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def served_by(conn, keys, label: str) -> Counter:
    import orjson

    from lorapool.records.job import DATA

    records = (orjson.loads(f[DATA.encode()]) for _, f in conn.xrange(keys.audit))
    return Counter(r["worker"] for r in records if r["request_id"].startswith(label))


def pool_run(args, flags: list[str], body) -> dict:
    """Two fresh workers on a fresh prefix; ``body(producer)``; their stats."""
    import redis

    from lorapool.cli.queue_status import live_workers
    from lorapool.producer import Producer

    conn = redis.Redis.from_url(args.redis_url)
    prefix = f"bench-sharing-{uuid.uuid4().hex[:8]}"
    producer = Producer(conn, prefix=prefix)
    with tempfile.TemporaryDirectory() as tmp:
        procs = start_workers(args, prefix, flags, Path(tmp))
        try:
            live = lambda: {w.name for w in live_workers(conn, producer.keys)}  # noqa: E731
            alive = lambda: live() == {"wa", "wb"}  # noqa: E731
            wait_for(alive, 60, "two workers")
            time.sleep(2.5)  # a heartbeat or two: each has counted the other
            result = body(producer)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(60)
            for key in conn.scan_iter(f"{prefix}:*"):
                conn.delete(key)
        stats = [json.loads((Path(tmp) / f"{n}.json").read_text()) for n in ("wa", "wb")]
    return {**result, "workers": stats}


def burst(args, fair: bool) -> dict:
    from lorapool.protocol import SamplingParams

    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def body(producer):
        shares = []
        for b in range(args.bursts):
            label = f"burst{b}-"
            ids = [f"{label}{i}" for i in range(args.burst_size)]
            producer.submit_many([PROMPT] * len(ids), params, request_ids=ids)
            served = Counter()
            while sum(served.values()) < len(ids):
                time.sleep(0.05)
                served = served_by(producer.redis, producer.keys, label)
            shares.append(served["wa"] / len(ids))
        return {"share_wa": shares, "smaller_share_min": min(min(s, 1 - s) for s in shares)}

    return pool_run(args, [] if fair else ["--no-fair-share"], body)


def skewed_adapters(args) -> list[str]:
    rng = random.Random(args.seed)
    names = [f"ad{r}" for r in range(args.adapters)]
    weights = [1.5**-r for r in range(args.adapters)]
    return rng.choices(names, weights, k=args.requests)


def affinity(args, on: bool) -> dict:
    from lorapool.protocol import SamplingParams

    chosen = skewed_adapters(args)

    def body(producer):
        for r in range(args.adapters):
            info = {"path": f"/adapters/ad{r}", "sha256": f"{r:064x}", "rank": 8, "alpha": 16.0}
            producer.registry.add(
                f"ad{r}", f"/adapters/ad{r}", r + 1, info | {"target_modules": []}
            )
        rng = random.Random(args.seed + 1)
        started, tick = time.monotonic(), 0.05
        for at in range(0, args.requests, max(1, int(args.rate * tick))):
            part = chosen[at : at + max(1, int(args.rate * tick))]
            params = [SamplingParams(max_tokens=rng.randint(8, 24), ignore_eos=True) for _ in part]
            ids = [f"aff-{at + i}" for i in range(len(part))]
            producer.submit_many([PROMPT] * len(part), params, part, ids)
            time.sleep(max(0.0, started + (at + len(part)) / args.rate - time.monotonic()))
        wait_for(lambda: producer.redis.xlen(producer.keys.audit) >= args.requests, 300, "all")
        return {}

    result = pool_run(args, [] if on else ["--no-affinity"], body)
    loads = sum(w["loads"] for w in result["workers"])
    handed = sum(w["handed"] for w in result["workers"])
    return {"loads_per_1000": 1000 * loads / args.requests, "handed": handed, **result}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--burst-size", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=200.0, help="affinity: requests per second")
    parser.add_argument("--adapters", type=int, default=40)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--load-ms", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["burst", "affinity"])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--serve-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-fair-share", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-affinity", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--stats", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_worker:
        serve_worker(args)
        return {}
    results = {}
    if args.only in (None, "burst"):
        for fair in (True, False):
            results[f"burst_{'fair' if fair else 'unfair'}"] = run = burst(args, fair)
            print(f"burst, fair share {fair}: share of wa per burst {run['share_wa']}", flush=True)
    if args.only in (None, "affinity"):
        for on in (True, False):
            results[f"affinity_{'on' if on else 'off'}"] = run = affinity(args, on)
            print(
                f"affinity {on}: {run['loads_per_1000']:.1f} loads per 1,000 requests, "
                f"{run['handed']} handed to a peer",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
