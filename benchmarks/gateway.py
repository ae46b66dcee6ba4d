"""The gateway's cost: streaming clients through ``lorapool serve`` against the same
load through ``AsyncProducer``, same worker, same run; then the gateway's own ceiling.

The worker is the real ``Worker`` around ``queue_gpu.StandInEngine`` (imported, not
copied): each step takes ``--step-ms`` and emits one token per running request.

1. Overhead: ``--clients`` streaming clients through the gateway (``/v1/completions``,
   ``stream=true``, one HTTP connection each) and as many through ``AsyncProducer``
   (``handle.chunks()``), each in its own process, started together for
   ``--seconds``: each client submits, reads its stream to the end, and again.
   Reported: tokens/s received by each side in the window and their ratio
   (gateway/direct, target >= 0.95), TTFT p50/p99 of each (submit to the first token)
   and the gateway's added TTFT p50 (target <= 10 ms).
2. Ceiling, the worker's engine replaced by the instant-token stand-in
   (``StandInEngine`` with 0 ms steps: every step emits at once): requests/s of
   ``--ceiling-clients`` clients streaming ``max_tokens=1`` completions; then
   ``--streams`` streams held open at once (``--stream-tokens`` each), with the
   tokens/s the gateway relays while holding them. The gateway is one asyncio process
   (one core at most): its CPU use during each phase says whether it was the limit.

    lorapool bench gateway [--clients 64] [--seconds 20] [--step-ms 33]
                           [--streams 512] [--json out.json]

Redis: ``--redis-url``, else ``$REDIS_URL``, else 127.0.0.1:6379/0. Auth is off
(``--no-auth``): an API key adds one Redis read per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from queue_gpu import AUDIT_KEY, BASE_MODEL, start_worker  # noqa: E402

PROMPT = [(7 * k) % 1000 for k in range(16)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# --- clients (each kind in its own process) ----------------------------------------
async def _gateway_client(http, url: str, max_tokens: int, end: float, out: dict) -> None:
    import orjson

    body = {"model": BASE_MODEL.name, "prompt": PROMPT, "max_tokens": max_tokens}
    body |= {"stream": True, "ignore_eos": True}
    while time.time() < end:
        start, first = time.time(), None
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode()
                raise RuntimeError(f"the gateway answered {response.status_code}: {text}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.time()
                event = orjson.loads(line[6:])
                tokens = sum(c["text"].count(" t") for c in event.get("choices", ()))
                if tokens and first is None:
                    first = now
                    out["ttft"].append(now - start)
                if now < end:
                    out["tokens"] += tokens
        out["requests"] += 1


async def _direct_client(producer, max_tokens: int, end: float, out: dict) -> None:
    from lorapool.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    while time.time() < end:
        start, first = time.time(), None
        handle = await producer.submit({"prompt_token_ids": PROMPT}, params)
        async for chunk in handle.chunks():
            now = time.time()
            if chunk.num_tokens and first is None:
                first = now
                out["ttft"].append(now - start)
            if now < end:
                out["tokens"] += chunk.num_tokens
        out["requests"] += 1


def run_clients(kind: str, target: str, prefix: str, n: int, max_tokens: int, t0, t1) -> dict:
    """``n`` clients of ``kind`` (gateway: ``target`` is its URL; direct: Redis's) from
    wall time ``t0`` to ``t1``; tokens counted only when they arrive before ``t1``."""

    async def main() -> dict:
        out = {"tokens": 0, "requests": 0, "ttft": []}
        await asyncio.sleep(max(0.0, t0 - time.time()))
        cpu0 = time.process_time()
        if kind == "gateway":
            import httpx

            limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
            async with httpx.AsyncClient(limits=limits, timeout=120) as http:
                await asyncio.gather(
                    *(_gateway_client(http, target, max_tokens, t1, out) for _ in range(n))
                )
        else:
            from lorapool.producer import AsyncProducer

            producer = AsyncProducer(target, prefix)
            await asyncio.gather(*(_direct_client(producer, max_tokens, t1, out) for _ in range(n)))
            await producer.aclose()
        out["cpu_share"] = (time.process_time() - cpu0) / (time.time() - t0)
        return out

    return asyncio.run(main())


async def _hold_streams(url: str, n: int, max_tokens: int) -> dict:
    """``n`` streams opened at once; how many were open together, tokens and seconds."""
    import httpx

    body = {"model": BASE_MODEL.name, "prompt": PROMPT, "max_tokens": max_tokens}
    body |= {"stream": True, "ignore_eos": True}
    state = {"open": 0, "max_open": 0, "tokens": 0, "done": 0}

    async def one(http) -> None:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode()
                raise RuntimeError(f"the gateway answered {response.status_code}: {text}")
            state["open"] += 1
            state["max_open"] = max(state["max_open"], state["open"])
            async for line in response.aiter_lines():
                state["tokens"] += line.count(" t") if line.startswith("data: {") else 0
            state["open"] -= 1
        state["done"] += 1

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    start = time.time()
    async with httpx.AsyncClient(limits=limits, timeout=300) as http:
        await asyncio.gather(*(one(http) for _ in range(n)))
    return {**state, "seconds": time.time() - start}


def hold_streams(url: str, n: int, max_tokens: int) -> dict:
    return asyncio.run(_hold_streams(url, n, max_tokens))


# --- processes ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(url: str, prefix: str, cwd: str) -> tuple[str, subprocess.Popen]:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", "serve"]
    cmd += ["--port", str(port), "--prefix", prefix, "--redis-url", url, "--no-auth"]
    cmd += ["--max-connections-per-client", "0"]  # one machine plays every client here
    cmd += ["--log-level", "warning"]
    # cwd outside the checkout: its root on sys.path would shadow the installed packages
    proc = subprocess.Popen(cmd, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return base, proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_up(url: str, prefix: str, sequences: int, step_ms: float, tmp: str):
    """The real Worker around the stand-in (``queue_gpu``'s serve-worker mode), once live."""
    import redis

    from lorapool.cli.queue_status import live_workers
    from lorapool.lifecycle.keys import Keys

    stats = Path(tmp) / f"stats-{step_ms:g}.json"
    proc = start_worker(url, prefix, sequences, step_ms, stats)
    name = f"gpu-{prefix}"  # the name start_worker gives it (its consumer: name#incarnation)
    deadline = time.monotonic() + 60
    with redis.Redis.from_url(url) as conn:
        while name not in {w.name for w in live_workers(conn, Keys(prefix))}:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the worker did not start")
            time.sleep(0.05)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- the run -----------------------------------------------------------------------
def overhead(args, url: str, gateway: str, gateway_pid: int, prefix: str) -> dict:
    t0 = time.time() + 3  # both client processes ready before it
    t1 = t0 + args.seconds
    cpu0 = cpu_s(gateway_pid)
    with ProcessPoolExecutor(2) as pool:
        via_gateway = pool.submit(
            run_clients, "gateway", gateway, prefix, args.clients, args.max_tokens, t0, t1
        )
        direct = pool.submit(
            run_clients, "direct", url, prefix, args.clients, args.max_tokens, t0, t1
        )
        via_gateway, direct = via_gateway.result(), direct.result()
    gateway_cpu = (cpu_s(gateway_pid) - cpu0) / (time.time() - t0)
    result = {}
    for name, side in (("gateway", via_gateway), ("direct", direct)):
        result[name] = {
            "tokens_per_s": side["tokens"] / args.seconds,
            "requests": side["requests"],
            "ttft_ms_p50": 1000 * percentile(side["ttft"], 0.5),
            "ttft_ms_p99": 1000 * percentile(side["ttft"], 0.99),
            "client_cpu_share": side["cpu_share"],  # the clients' own process, of a core
        }
    result["ratio"] = result["gateway"]["tokens_per_s"] / result["direct"]["tokens_per_s"]
    result["added_ttft_ms_p50"] = result["gateway"]["ttft_ms_p50"] - result["direct"]["ttft_ms_p50"]
    result["gateway_cpu_share"] = gateway_cpu  # of one core, whole phase
    return result


def ceiling(args, gateway: str, gateway_pid: int, prefix: str) -> dict:
    t0 = time.time() + 2
    t1 = t0 + args.ceiling_seconds
    cpu0 = cpu_s(gateway_pid)
    with ProcessPoolExecutor(1) as pool:
        side = pool.submit(
            run_clients, "gateway", gateway, prefix, args.ceiling_clients, 1, t0, t1
        ).result()
    requests_cpu = (cpu_s(gateway_pid) - cpu0) / (time.time() - t0)
    cpu0 = cpu_s(gateway_pid)
    with ProcessPoolExecutor(1) as pool:
        held = pool.submit(hold_streams, gateway, args.streams, args.stream_tokens).result()
    streams_cpu = (cpu_s(gateway_pid) - cpu0) / held["seconds"]
    return {
        "requests_per_s": side["requests"] / args.ceiling_seconds,
        "requests_ttft_ms_p50": 1000 * percentile(side["ttft"], 0.5),
        "requests_gateway_cpu_share": requests_cpu,
        # what one core would serve at the measured CPU per request (the clients and the
        # worker share this machine's cores with the gateway)
        "requests_per_core_s": side["requests"] / args.ceiling_seconds / requests_cpu,
        "streams": args.streams,
        "streams_open_together": held["max_open"],
        "streams_finished": held["done"],
        "streams_tokens_per_s": held["tokens"] / held["seconds"],
        "streams_expected_tokens": args.streams * args.stream_tokens,
        "streams_tokens": held["tokens"],
        "streams_gateway_cpu_share": streams_cpu,
        "streams_tokens_per_core_s": held["tokens"] / held["seconds"] / streams_cpu,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64, help="streaming clients a side")
    parser.add_argument("--seconds", type=float, default=20.0, help="overhead phase length")
    parser.add_argument("--step-ms", type=float, default=33.0, help="stand-in step time")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens a request")
    parser.add_argument("--ceiling-clients", type=int, default=64)
    parser.add_argument("--ceiling-seconds", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=512, help="streams held at once")
    parser.add_argument("--stream-tokens", type=int, default=128, help="tokens a held stream")
    parser.add_argument("--skip-ceiling", action="store_true")
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("LORAPOOL_AUDIT_KEY", AUDIT_KEY)
    prefix = f"bench-gw-{uuid.uuid4().hex[:8]}"
    sequences = max(2 * args.clients, args.ceiling_clients, args.streams)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        worker = worker_up(args.redis_url, prefix, sequences, args.step_ms, tmp)
        gateway, gateway_proc = start_gateway(args.redis_url, prefix, tmp)
        try:
            shape = f"{args.step_ms:g} ms steps, {args.max_tokens} tokens a request"
            print(f"overhead: {args.clients} clients a side, {args.seconds:g} s, {shape}")
            results["overhead"] = overhead(args, args.redis_url, gateway, gateway_proc.pid, prefix)
            print(json.dumps(results["overhead"], indent=1), flush=True)
            if not args.skip_ceiling:
                stop(worker)
                worker = worker_up(args.redis_url, prefix, sequences, 0.0, tmp)
                print("ceiling (instant-token engine):", flush=True)
                results["ceiling"] = ceiling(args, gateway, gateway_proc.pid, prefix)
                print(json.dumps(results["ceiling"], indent=1), flush=True)
        finally:
            stop(gateway_proc)
            stop(worker)
            _clean(args.redis_url, prefix)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


def _clean(url: str, prefix: str) -> None:
    import redis

    with redis.Redis.from_url(url) as conn:
        for key in conn.scan_iter(f"{prefix}:*", count=1000):
            conn.delete(key)


if __name__ == "__main__":
    main()
