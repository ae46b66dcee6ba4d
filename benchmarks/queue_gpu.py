"""Queue path at GPU step rates: the real Worker driving an engine stand-in.

A CPU engine step takes ~350 ms, which hides what the queue path costs; a GPU
step takes 15-35 ms. ``StandInEngine`` does what a GPU engine does as seen from
the worker: each step takes ``--step-ms`` (a sleep, as a GPU kernel leaves the CPU
free) and then emits one token per running request, deterministic
(``token_of(request_id, position)``) so every stream can be checked exactly.

One run, per step time:

- in-process: the stand-in stepped by a bare loop (its own step rate, the peer);
- queue: ``Producer.submit_many`` → real Redis → one worker process (the real
  ``Worker`` around the stand-in) → chunk logs; then every log is read back and
  checked token for token against ``token_of``.

Reported: steady-state steps/s and tokens/s of both (first to last full-batch step)
and their ratios; worker CPU per token (the worker process's minus the stand-in's own,
over full-batch steps); Redis CPU per token (``INFO cpu``, submission done to the last
final record); bytes Redis keeps per token streaming, and per finished request.

    lorapool bench queue-path [--sequences 256] [--step-ms 33 16.7] [--json out.json]

Redis: ``--redis-url``, else ``$REDIS_URL``, else 127.0.0.1:6379/0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (tests/support)
    sys.path.append(str(Path(__file__).resolve().parent))
from _redis_measure import chunk_log_bytes, finished_bytes, redis_cpu_s  # noqa: E402
from standin_engine import (  # noqa: E402
    AUDIT_KEY,
    BASE_MODEL,
    VOCAB,
    StandInEngine,
    token_of,
)


def workload(num_requests: int, max_tokens: int, label: str) -> list[tuple[str, list[int], int]]:
    """16-token prompts; outputs spread over max_tokens/2 .. 3*max_tokens/2, so requests
    finish and start every step, as in a serving pool (not in waves)."""
    low = max(1, max_tokens // 2)
    return [
        (
            f"{label}-{i}",
            [(i * 7 + k) % VOCAB for k in range(16)],
            low + (i * 37) % (max_tokens + 1),
        )
        for i in range(num_requests)
    ]


def run_inprocess(sequences: int, step_s: float, jobs) -> dict[str, float]:
    from lorapool.protocol import SamplingParams

    engine = StandInEngine(sequences, step_s)
    for rid, prompt, max_tokens in jobs:
        engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.full_batch_stats()


def serve_worker(args) -> None:
    """Run the real Worker around the stand-in until SIGTERM; write its stats."""
    from lorapool import heap
    from lorapool.connection import connect
    from lorapool.worker import Worker, WorkerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    engine = StandInEngine(args.sequences, args.step_ms / 1000)
    config = WorkerConfig(
        prefix=args.prefix,
        shards=args.shards,
        name=args.name,
        audit_key=AUDIT_KEY.encode(),
        lease_s=args.lease_s,
        max_chunk_rate=args.max_chunk_rate,
    )
    worker = Worker(engine, connect(args.redis_url), config, BASE_MODEL)
    heap.quiet()  # as ``lorapool worker`` (``worker/serve.py``) runs it
    worker.run()
    if not args.stats:
        return
    stats = engine.full_batch_stats()
    stats["step_end"] = [s[1] for s in engine.steps]  # perf_counter (same clock host-wide)
    stats["first_step"] = engine.first_step
    Path(args.stats).write_text(json.dumps(stats))


def start_worker(
    url: str, prefix: str, sequences: int, step_ms: float, stats: Path, shards=0, rate=3000
):
    cmd = [sys.executable, __file__, "--serve-worker", "--redis-url", url, "--prefix", prefix]
    cmd += ["--shards", str(shards), "--max-chunk-rate", str(rate)]
    cmd += ["--name", f"gpu-{prefix}", "--sequences", str(sequences)]
    cmd += ["--step-ms", str(step_ms), "--stats", str(stats)]
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL)


def check_streams(conn, keys, jobs) -> tuple[int, int]:
    """Every log read back equals the stand-in's output exactly; returns (mismatches,
    chunks in all)."""
    from lorapool.lifecycle.chunk_log import log_chunks

    bad = chunks = 0
    for rid, _, max_tokens in jobs:
        tokens, finals = [], 0
        log = log_chunks(conn, keys, rid)
        chunks += len(log)
        for chunk in log:
            for out in chunk.outputs:
                tokens += out.token_ids
            finals += chunk.finished
        bad += tokens != [token_of(rid, k) for k in range(max_tokens)] or finals != 1
    return bad, chunks


def run_queue(url: str, sequences: int, step_ms: float, jobs, shards=0, rate=3000) -> dict:
    from lorapool.producer import Producer
    from lorapool.protocol import SamplingParams

    prefix = f"bench-gpu-{uuid.uuid4().hex[:8]}"
    producer = Producer(url, prefix=prefix, shards=shards)
    conn, keys = producer.redis, producer.keys
    with tempfile.TemporaryDirectory() as tmp:
        stats_file = Path(tmp) / "stats.json"
        worker = start_worker(url, prefix, sequences, step_ms, stats_file, shards, rate)
        try:
            deadline = time.monotonic() + 60
            while not conn.hlen(keys.workers):
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the worker did not start")
                time.sleep(0.05)
            params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, _, n in jobs]
            prompts = [{"prompt_token_ids": p} for _, p, _ in jobs]
            ids = [rid for rid, _, _ in jobs]
            for start in range(0, len(jobs), 512):
                end = start + 512
                producer.submit_many(
                    prompts[start:end], params[start:end], request_ids=ids[start:end]
                )
            cpu0, t0 = redis_cpu_s(conn), time.perf_counter()
            streaming = None
            while (done := sum(conn.xlen(v.audit) for v in keys.shard_views)) < len(jobs):
                if worker.poll() is not None:
                    raise RuntimeError("the worker exited")
                if streaming is None and done >= len(jobs) // 4:
                    # mid-run: the requests after the finished ones are the running ones
                    streaming = chunk_log_bytes(conn, [keys.out(r) for r in ids[done:][:64]])
                time.sleep(0.1)
            redis_cpu, seconds = redis_cpu_s(conn) - cpu0, time.perf_counter() - t0
            worker.send_signal(signal.SIGTERM)
            worker.wait(120)
            stats = json.loads(stats_file.read_text())
            bad, chunks = check_streams(conn, keys, jobs)
            finished = finished_bytes(conn, keys, ids[:64])
        finally:
            if worker.poll() is None:
                worker.kill()
            for key in list(conn.scan_iter(match=keys.pattern, count=1000)):
                conn.delete(key)
    tokens = sum(n for _, _, n in jobs)
    return {
        "steps_per_s": stats["steps_per_s"],
        "steady_tokens_per_s": stats["tokens_per_s"],
        "gap_ms": [round(stats[f"gap_ms_{k}"], 2) for k in ("p50", "p99", "mean")],
        "step_ms_mean": stats["step_ms_mean"],
        "occupancy": stats["occupancy"],
        "worker_cpu_us_per_token": 1e6 * stats["cpu_s"] / max(1, stats["tokens"]),
        "redis_cpu_us_per_token": 1e6 * redis_cpu / tokens,
        "tokens_per_s": tokens / seconds,
        "streaming_bytes_per_token": (streaming[0] / max(1, streaming[1])) if streaming else None,
        # kept once the log's grace is over: the job hash with the record, vs the record
        "finished_bytes_per_request": finished[0] / 64,
        "final_record_bytes": finished[1] / 64,
        "stored_record_bytes": finished[2] / 64,  # compressed
        "mismatched_streams": bad,
        "chunks_per_token": chunks / tokens,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[33.0, 16.7])
    parser.add_argument("--requests", type=int, default=0, help="default: 4 x sequences")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--serve-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--stats", help=argparse.SUPPRESS)
    parser.add_argument("--lease-s", type=float, default=10.0, help=argparse.SUPPRESS)
    parser.add_argument("--max-chunk-rate", type=int, default=3000, help="the worker's")
    parser.add_argument(
        "--shards",
        type=int,
        default=0,
        help="the pool's shards (with a cluster URL, redis+cluster://host:port; default 0)",
    )
    args = parser.parse_args(argv)
    if args.serve_worker:
        args.step_ms = args.step_ms[0]
        serve_worker(args)
        return {}
    os.environ.setdefault("LORAPOOL_AUDIT_KEY", AUDIT_KEY)
    num = args.requests or 4 * args.sequences
    if num < 2 * args.sequences:
        # the steady state is the steps that ran a full batch while work was queued
        parser.error(
            f"--requests must be at least twice --sequences ({2 * args.sequences}), got {num}: "
            "with fewer the batch never runs full and there is no steady state to measure"
        )
    results = {}
    for step_ms in args.step_ms:
        jobs = workload(num, args.max_tokens, f"r{step_ms:g}")
        print(f"step {step_ms:g} ms, {args.sequences} sequences, {num} requests:", flush=True)
        peer = run_inprocess(args.sequences, step_ms / 1000, jobs)
        print(f"  in-process: {peer['steps_per_s']:.2f} steps/s", flush=True)
        queue = run_queue(
            args.redis_url, args.sequences, step_ms, jobs, args.shards, args.max_chunk_rate
        )
        peer_cpu = 1e6 * peer["cpu_s"] / max(1, peer["tokens"])
        queue["ratio"] = queue["steps_per_s"] / peer["steps_per_s"]
        queue["token_ratio"] = queue["steady_tokens_per_s"] / peer["tokens_per_s"]
        queue["stand_in_cpu_us_per_token"] = peer_cpu
        queue["worker_cpu_us_per_token"] -= peer_cpu
        queue["in_process_steps_per_s"] = peer["steps_per_s"]
        queue["step_ms"] = [round(peer["step_ms_mean"], 2), round(queue.pop("step_ms_mean"), 2)]
        results[f"{step_ms:g}ms"] = queue
        print(
            "  queue: "
            + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in queue.items()
            ),
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
