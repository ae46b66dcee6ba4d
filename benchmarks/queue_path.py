"""Queue benchmark: the engine benchmark's workload through the queue against in-process.

One run measures, on the same workload (``benchmarks/engine.py::make_workload``:
prompts 16-512 tokens, outputs 16-256, greedy, every request arriving at once):

- in-process: one ``LLMEngine`` stepped directly (in a fresh interpreter);
- queue, 1 worker: ``Producer.submit_many`` → Redis → one ``lorapool worker``
  process → the client following every request (``AsyncProducer``: live channel,
  gaps filled from the chunk log; idle between chunks, as a blocking XREAD was);
- queue, 2 workers: the same with two worker processes, splitting ``--threads``
  (torch threads of the engine side: the in-process engine and one worker get them
  all, two workers half each).

Throughput is output tokens / (last final output - submission). TTFT is, in
process, the engine's first-token time minus arrival; through the queue, the
moment the client holds a request's first token minus submission. Reported:
queue / in-process throughput, added TTFT p50 in ms, and 2 workers / 1 worker.
Each side first runs a few warm-up requests (kernel compilation, caches).

    lorapool bench queue [--model DIR] [--requests 64] [--device auto] [--json out.json]

Redis: ``--redis-url``, else ``$REDIS_URL``, else the embedded Redis.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 4


def _engine_bench():
    """benchmarks/engine.py, imported by path (its name would clash with lorapool's engine/)."""
    spec = importlib.util.spec_from_file_location("lorapool_bench_engine", HERE / "engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _engine_bench()


def load_workload(model: str, num_requests: int, seed: int = 0):
    """The engine benchmark's workload (seed 0); warm-up requests use another seed."""
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    return BENCH.make_workload(num_requests, vocab, seed=seed)


def progress(label: str, done: int, total: int, start: float) -> None:
    if done == total or done % max(1, total // 10) == 0:
        print(
            f"  {label}: {done}/{total} requests, {time.perf_counter() - start:.1f}s",
            file=sys.stderr,
            flush=True,
        )


def summary(tokens: int, seconds: float, ttfts: list[float], errors: int = 0) -> dict:
    return {
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(tokens / seconds, 1),
        "ttft_p50_ms": round(1000 * BENCH.percentile(ttfts, 50), 2),
        "ttft_p99_ms": round(1000 * BENCH.percentile(ttfts, 99), 2),
        "errors": errors,
    }


# --- in-process ------------------------------------------------------------------


def run_inprocess(model: str, workload, device: str, threads: int) -> dict:
    import torch

    from lorapool import EngineArgs, LLMEngine, SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, device=device, max_num_seqs=64, max_num_batched_tokens=2048)
    )
    _drive(engine, load_workload(model, WARMUP, seed=1), SamplingParams, "warm-up")
    return _drive(engine, workload, SamplingParams, "in-process")


def _drive(engine, workload, params_class, label: str) -> dict:
    params = [params_class(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]

    def report(done, total, start):
        progress(label, done, total, start)

    return summary(*BENCH.drive(engine, workload, params, label=f"{label}-", report=report))


def run_inprocess_side(model: str, num_requests: int, device: str, threads: int) -> dict:
    """The in-process side in a fresh interpreter (cwd outside the checkout)."""
    code = (
        "import runpy, sys; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    cmd = [
        sys.executable,
        "-c",
        code,
        str(HERE / "queue_path.py"),
        "--side",
        "inprocess",
        "--model",
        model,
        "--requests",
        str(num_requests),
        "--device",
        device,
        "--threads",
        str(threads),
    ]
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=cwd)
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- through the queue --------------------------------------------------------------


def start_workers(
    count: int, model: str, url: str, prefix: str, device: str, threads: int, cwd: str
) -> list[subprocess.Popen]:
    cmd = [
        sys.executable,
        "-c",
        "from lorapool.cli.main import main; main()",
        "worker",
        "--model",
        model,
        "--device",
        device,
        "--redis-url",
        url,
        "--prefix",
        prefix,
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "2048",
    ]
    # the engines share the machine's --threads: two workers get half each, as two
    # engine processes on one CPU box would be set up (with the whole count each, four
    # compute threads fought over two cores and the 2-worker row measured that)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads // count))}
    if not (env.get("LORAPOOL_AUDIT_KEY") or env.get("LORAPOOL_AUDIT_KEY_FILE")):
        # workers refuse to start without a key to sign audit records with
        env["LORAPOOL_AUDIT_KEY"] = "lorapool-benchmark-audit-key-0123456789"
    return [
        subprocess.Popen(
            cmd + ["--name", f"bench-{i}"], cwd=cwd, env=env, stderr=subprocess.DEVNULL
        )
        for i in range(count)
    ]


def wait_workers(producer, workers, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while producer.redis.hlen(producer.keys.workers) < len(workers):
        if any(w.poll() is not None for w in workers):
            raise RuntimeError("a worker exited while starting")
        if time.monotonic() > deadline:
            raise RuntimeError("workers did not start")
        time.sleep(0.1)


def submit(producer, workload, label: str):
    from lorapool.protocol import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    ids = [f"{label}-{i}" for i in range(len(workload))]
    producer.submit_many([{"prompt_token_ids": p} for p, _ in workload], params, request_ids=ids)
    return ids


def collect(url: str, producer, ids: list[str], label: str, start: float) -> dict:
    """Follow every request's chunks until its final one, as an asyncio client does
    (``AsyncProducer``'s Follower: one Pub/Sub connection, waiting idle between
    chunks, so it takes no CPU from the workers); client-side timings."""
    import asyncio

    from lorapool.producer import AsyncProducer

    first_token: dict[str, float] = {}
    counts = {"tokens": 0, "errors": 0, "done": 0}

    async def follow(client, rid: str) -> None:
        async for chunk in (await client.handle(rid)).chunks():
            counts["tokens"] += chunk.num_tokens
            if chunk.num_tokens and rid not in first_token:
                first_token[rid] = time.perf_counter() - start
            if chunk.finished:
                counts["errors"] += chunk.error is not None
                counts["done"] += 1
                progress(label, counts["done"], len(ids), start)

    async def follow_all() -> None:
        client = AsyncProducer(url, prefix=producer.keys.prefix)
        try:
            await asyncio.gather(*(follow(client, rid) for rid in ids))
        finally:
            await client.aclose()

    asyncio.run(follow_all())
    return summary(
        counts["tokens"], time.perf_counter() - start, list(first_token.values()), counts["errors"]
    )


def run_queue(args, url: str, num_workers: int, workload) -> dict:
    from lorapool.producer import Producer

    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    producer = Producer(url, prefix=prefix)
    with tempfile.TemporaryDirectory() as cwd:
        workers = start_workers(
            num_workers, args.model, url, prefix, args.device, args.threads, cwd
        )
        try:
            wait_workers(producer, workers)
            warm = load_workload(args.model, WARMUP * num_workers, seed=1)
            warm_ids = submit(producer, warm, "warm-up")
            collect(url, producer, warm_ids, "warm-up", time.perf_counter())
            start = time.perf_counter()
            ids = submit(producer, workload, "queue")
            result = collect(url, producer, ids, f"{num_workers} worker(s)", start)
        finally:
            stop(workers)
            for key in producer.redis.scan_iter(f"{prefix}:*"):
                producer.redis.delete(key)
    return result


def stop(workers: list[subprocess.Popen]) -> None:
    for w in workers:
        w.send_signal(signal.SIGTERM)
    for w in workers:
        try:
            w.wait(60)
        except subprocess.TimeoutExpired:
            w.kill()


# --- main ------------------------------------------------------------------------------


def report(results: dict) -> dict:
    inproc, one, two = results["in_process"], results["queue_1_worker"], results["queue_2_workers"]
    results["throughput_ratio_queue_vs_in_process"] = round(
        one["output_tokens_per_s"] / inproc["output_tokens_per_s"], 3
    )
    results["added_ttft_p50_ms"] = round(one["ttft_p50_ms"] - inproc["ttft_p50_ms"], 2)
    results["throughput_ratio_2_vs_1_worker"] = round(
        two["output_tokens_per_s"] / one["output_tokens_per_s"], 3
    )
    return results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads of the engine side (split by workers)"
    )
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--side", choices=["inprocess"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.model is None:
        from lorapool.settings import smollm2_dir

        args.model = str(smollm2_dir())
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    workload = load_workload(args.model, args.requests)
    if args.side:
        print(json.dumps(run_inprocess(args.model, workload, args.device, args.threads)))
        return {}
    from lorapool.embedded import resolve_url

    url = args.redis_url or resolve_url()
    print("in-process:", file=sys.stderr)
    results = {
        "in_process": run_inprocess_side(args.model, args.requests, args.device, args.threads)
    }
    for count, name in ((1, "queue_1_worker"), (2, "queue_2_workers")):
        print(f"queue, {count} worker(s):", file=sys.stderr)
        results[name] = run_queue(args, url, count, workload)
    report(results)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
