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
import zlib
from collections import deque
from pathlib import Path

VOCAB = 49152
BASE_MODEL = {"name": "stand-in", "sha256": "0" * 64}
AUDIT_KEY = "lorapool-benchmark-audit-key-0123456789"

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (tests/support)
    sys.path.append(str(Path(__file__).resolve().parent))
from _redis_measure import chunk_log_bytes, finished_bytes, redis_cpu_s  # noqa: E402


def token_of(request_id: str, position: int) -> int:
    """The stand-in's output: token ``position`` of ``request_id`` (any process, any run)."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % VOCAB


class _Request:
    __slots__ = ("request_id", "prompt_len", "max_tokens", "done", "arrival", "first", "lora")

    def __init__(self, request_id, prompt_len, max_tokens, done, arrival, lora):
        self.request_id, self.prompt_len, self.max_tokens = request_id, prompt_len, max_tokens
        self.done, self.arrival, self.first, self.lora = done, arrival, None, lora


class StandInEngine:
    """A GPU engine as the worker sees it (``lorapool.worker.engine_api``).

    ``timeline``: records per step its start, end, process CPU time and running
    count, and per request the step of its first new token (for latencies).
    """

    def __init__(self, max_num_seqs: int = 256, step_s: float = 0.033):
        self.max_num_seqs, self.step_s = max_num_seqs, step_s
        self.waiting: deque[_Request] = deque()
        self.running: dict[str, _Request] = {}
        self.aborted: list[_Request] = []
        self.steps: list[tuple[float, float, float, int]] = []  # start, end, cpu, running
        self.first_step: dict[str, int] = {}  # request -> step index of its first token
        self.device_name = f"stand-in ({step_s * 1000:g} ms steps)"

    # --- the worker's interface ---------------------------------------------------
    def add_request(
        self,
        request_id,
        prompt,
        params=None,
        arrival_time=None,
        lora_request=None,
        resume_token_ids=None,
    ):
        if request_id in self.running or any(r.request_id == request_id for r in self.waiting):
            raise ValueError(f"request {request_id} is already running")
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        prompt_len = len(ids) if ids is not None else len(str(prompt).split())
        max_tokens = params.max_tokens if params is not None and params.max_tokens else 16
        done = len(resume_token_ids or [])
        arrival = arrival_time or time.time()
        self.waiting.append(
            _Request(request_id, prompt_len, max_tokens, done, arrival, lora_request)
        )

    def abort_request(self, request_id):
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for rid in ids:
            request = self.running.pop(rid, None)
            if request is not None:
                self.aborted.append(request)
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)

    def expect_lora_weights(self, lora_request, sha256):
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.aborted)

    def capacity(self) -> int:
        """The engine's rule (``engine/engine_stats.py``) for a KV cache that never runs
        out of blocks and one sequence a request: the slots neither running nor waiting
        requests hold (a request waiting for a slot does not stop the worker from
        reading into the free ones; none starves, as none is ever skipped)."""
        return max(0, self.max_num_seqs - len(self.running) - len(self.waiting))

    def request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def running_request_ids(self) -> set[str]:
        return set(self.running)

    def step(self) -> list:
        from lorapool.outputs import CompletionOutput, RequestMetrics, RequestOutput

        start = time.perf_counter()
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            self.running[request.request_id] = request
        time.sleep(self.step_s)  # the GPU's part: the CPU is free meanwhile
        index, now = len(self.steps), time.time()
        outputs = [self._final(r, "abort", now) for r in self.aborted]
        self.aborted = []
        for rid, request in list(self.running.items()):
            token = token_of(rid, request.done)
            request.done += 1
            if request.first is None:
                request.first = now
                self.first_step[rid] = index
            finished = request.done >= request.max_tokens
            completion = CompletionOutput(
                0, f" t{token}", [token], None, None, "length" if finished else None
            )
            metrics = None
            if finished:
                del self.running[rid]
                metrics = RequestMetrics(
                    request.arrival,
                    first_token_time=request.first,
                    last_token_time=now,
                    finished_time=now,
                    num_prompt_tokens=request.prompt_len,
                    num_generated_tokens=request.done,
                )
            outputs.append(
                RequestOutput(rid, None, None, None, [completion], finished, metrics, request.lora)
            )
        self.steps.append((start, time.perf_counter(), time.process_time(), len(outputs)))
        return outputs

    def _final(self, request: _Request, reason: str, now: float):
        from lorapool.outputs import CompletionOutput, RequestOutput

        completion = CompletionOutput(0, "", [], None, None, reason)
        return RequestOutput(request.request_id, None, None, None, [completion], True)

    # --- what the benchmark reads -------------------------------------------------
    def full_batch_stats(self) -> dict[str, float]:
        """Steady state: every step from the first to the last that ran a full batch
        (while the queue still had work). Steps/s, tokens/s, CPU seconds and how full
        the batch was on average (requests admitted a step late show there)."""
        full = [i for i, s in enumerate(self.steps) if s[3] >= self.max_num_seqs]
        if len(full) < 3:
            return {"steps": len(full), "steps_per_s": 0.0, "tokens": 0, "cpu_s": 0.0}
        first, last = full[0], full[-1]
        span = self.steps[last][0] - self.steps[first][0]
        tokens = sum(s[3] for s in self.steps[first + 1 : last + 1])
        gaps = sorted(
            self.steps[i + 1][0] - self.steps[i][1] for i in range(first, last)
        )  # the worker's time between one step's end and the next one's start
        return {
            "gap_ms_p50": 1000 * gaps[len(gaps) // 2],
            "gap_ms_p99": 1000 * gaps[int(len(gaps) * 0.99)],
            "gap_ms_mean": 1000 * sum(gaps) / len(gaps),
            "step_ms_mean": 1000 * sum(s[1] - s[0] for s in self.steps[first:last]) / len(gaps),
            "steps": last - first,
            "steps_per_s": (last - first) / span,
            "tokens_per_s": tokens / span,
            "occupancy": tokens / ((last - first) * self.max_num_seqs),
            "tokens": tokens,
            "cpu_s": self.steps[last][2] - self.steps[first][2],
        }


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
    from lorapool.connection import connect
    from lorapool.worker import Worker, WorkerConfig, heap

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
                tokens += out["token_ids"]
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
