"""Readers at GPU step rates: what following many streams costs Redis, and how soon a
client sees a step's tokens.

The real Worker around ``queue_gpu``'s engine stand-in (a process) streams
``--requests`` requests while one asyncio client follows all of them, two ways in
the same run:

- ``none``: nobody reads (the worker's own Redis CPU: the peer to subtract);
- ``follower``: ``AsyncProducer``'s ``Follower``, one Pub/Sub connection for all.

(Until the chunk log became a list, a third way was one blocking XREAD per request,
what ``AsyncJobHandle`` did before the Follower: RESULTS.md has its numbers.)

The ways alternate, ``--repeat`` times (none, follower, none, follower, ...).
Reported per follower run: Redis CPU per delivered chunk beyond the ``none`` run
before it (``INFO cpu``; the ``none`` run's CPU scaled by the chunks Redis appended
in each run, ``INFO commandstats``' RPUSH calls, since how the worker coalesces
moves a little between runs), and the latency from the end of the engine step
that made a chunk's last token to the client holding it (p50 / p99; the readers
start following just before the submit), from the stand-in's step-end times
(``time.perf_counter``, one clock for every process on the host); then the
median over the runs.

The client is ``AsyncProducer`` on a URL, as a gateway makes it: its connections
come from ``connect_async``'s bounded pool.

    lorapool bench queue_readers [--requests 256] [--step-ms 25] [--repeat 3]
                                 [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "queue_gpu", Path(__file__).with_name("queue_gpu.py")
)
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)
from _redis_measure import command_calls  # noqa: E402  (queue_gpu put benchmarks/ on the path)


async def follow(producer, ids, way: str, received: list) -> None:
    """Read every request's chunks ``way``; (request, last token position, time) each."""

    async def by_follower(rid):
        async for chunk in (await producer.handle(rid)).chunks():
            received.append((rid, chunk.offset + chunk.num_tokens - 1, time.perf_counter()))

    await asyncio.gather(*(by_follower(rid) for rid in ids))


async def run_way(url: str, way: str, args, jobs) -> dict:
    import redis

    from lorapool.producer import AsyncProducer
    from lorapool.protocol import SamplingParams

    prefix = f"bench-read-{uuid.uuid4().hex[:8]}"
    producer = AsyncProducer(url, prefix=prefix)
    conn = redis.Redis.from_url(url)
    received: list = []
    with tempfile.TemporaryDirectory() as tmp:
        stats_file = Path(tmp) / "stats.json"
        worker = gpu.start_worker(url, prefix, args.sequences, args.step_ms, stats_file)
        try:
            while not conn.hlen(producer.keys.workers):
                time.sleep(0.05)
            ids = [rid for rid, _, _ in jobs]
            cpu0, appends0 = gpu.redis_cpu_s(conn), command_calls(conn, "rpush")
            reading = None
            if way != "none":  # readers follow first, as a gateway that submits then reads
                reading = asyncio.ensure_future(follow(producer, ids, way, received))
                await asyncio.sleep(0.5)
            await producer.submit_many(
                [{"prompt_token_ids": p} for _, p, _ in jobs],
                [SamplingParams(max_tokens=n, ignore_eos=True) for _, _, n in jobs],
                request_ids=ids,
            )
            while reading is None and conn.xlen(producer.keys.audit) < len(jobs):
                await asyncio.sleep(0.05)
            if reading is not None:
                await reading
            redis_cpu = gpu.redis_cpu_s(conn) - cpu0
            appended = command_calls(conn, "rpush") - appends0
            worker.send_signal(signal.SIGTERM)
            worker.wait(120)
            stats = json.loads(stats_file.read_text())
        finally:
            if worker.poll() is None:
                worker.kill()
            await producer.aclose()
            for key in conn.scan_iter(f"{prefix}:*", count=1000):
                conn.delete(key)
    return {"redis_cpu_s": redis_cpu, "appended": appended, **latencies(received, stats)}


def latencies(received: list, stats: dict) -> dict:
    """Step end of each chunk's last token (first step + position) to its receipt."""
    ends, first = stats["step_end"], stats["first_step"]
    lat = sorted(1000 * (t - ends[first[rid] + pos]) for rid, pos, t in received)
    if not lat:
        return {"chunks": 0}
    return {
        "chunks": len(lat),
        "latency_ms_p50": round(lat[len(lat) // 2], 2),
        "latency_ms_p99": round(lat[int(len(lat) * 0.99)], 2),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=25.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--ways", nargs="+", default=["none", "follower"], choices=["none", "follower"]
    )
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each way, alternating")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("LORAPOOL_AUDIT_KEY", gpu.AUDIT_KEY)
    runs: dict[str, list[dict]] = {way: [] for way in args.ways}
    for _ in range(args.repeat):
        for way in args.ways:
            jobs = gpu.workload(args.requests, args.max_tokens, f"{way}-{uuid.uuid4().hex[:4]}")
            result = asyncio.run(run_way(args.redis_url, way, args, jobs))
            base = runs["none"][-1] if way != "none" and runs.get("none") else None
            if base is not None and result.get("chunks"):
                scaled = base["redis_cpu_s"] * result["appended"] / max(1, base["appended"])
                result["reader_redis_cpu_us_per_chunk"] = round(
                    1e6 * (result["redis_cpu_s"] - scaled) / result["chunks"], 2
                )
            runs[way].append(result)
            print(way, result, flush=True)
    results = {"runs": runs}
    for way, done in runs.items():
        for figure in ("reader_redis_cpu_us_per_chunk", "latency_ms_p50", "latency_ms_p99"):
            values = sorted(r[figure] for r in done if figure in r)
            if values:
                results.setdefault(way, {})[figure + "_median"] = values[len(values) // 2]
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
