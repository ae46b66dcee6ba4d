"""A light tenant's one-token chat completions at several cadences, over a real
``lorapool serve`` and ``lorapool worker``: each call's latency, p50 and p99 by the
pause between calls.

A call's wait that depends on when it comes (a listener's poll, a reader's block) shows
as a p50 that changes with the pause: the gateway's follower once slept 20 ms between
20 ms reads while nothing was followed, and calls one every 0.1 s took 45 ms against
12-19 ms at other pauses. The pauses are run in turn, ``--rounds`` times, so a noisy
machine hits each alike.

    lorapool bench call_cadence [--pauses 0,0.05,0.1,0.2,0.5] [--calls 40] [--rounds 2]
                                [--model DIR] [--json out.json]

Redis: ``--redis-url``, else ``$REDIS_URL``, else 127.0.0.1:6379/0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as `lorapool bench` runs it too

from hostile_tenants import percentile, start, stop, wait_ready  # noqa: E402


async def calls(url: str, headers: dict, model: str, count: int, pause: float) -> list[float]:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    latencies = []
    async with httpx.AsyncClient() as http:
        for _ in range(count):
            began = time.monotonic()
            reply = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            if reply.status_code != 200:
                raise SystemExit(f"a call failed: {reply.status_code} {reply.text[:300]}")
            latencies.append(time.monotonic() - began)
            await asyncio.sleep(pause)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--pauses", default="0,0.05,0.1,0.2,0.5")
    parser.add_argument("--calls", type=int, default=40, help="calls a pause a round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    pauses = [float(p) for p in args.pauses.split(",") if p]
    if args.model is None:
        from lorapool.settings import smollm2_dir

        args.model = str(smollm2_dir())
    args.worker_arg, args.gateway_arg, args.worker_cpus = [], [], None  # start()'s

    import redis

    from lorapool.lifecycle.keys import Keys
    from lorapool.producer.api_keys import ApiKeys

    prefix = f"bench-cadence-{uuid.uuid4().hex[:8]}"
    conn = redis.Redis.from_url(args.redis_url)
    headers = {"Authorization": f"Bearer {ApiKeys(conn, Keys(prefix)).add('light', 'submit')[1]}"}
    workdir = tempfile.mkdtemp(prefix="bench-cadence-")
    procs, url = start(args, prefix, workdir)
    by_pause: dict[float, list[float]] = {p: [] for p in pauses}
    try:
        model = wait_ready(url, procs, headers)
        asyncio.run(calls(url, headers, model, 20, 0.05))  # first shapes, template, tokenizer
        for k in range(args.rounds):
            for pause in pauses:
                by_pause[pause] += asyncio.run(calls(url, headers, model, args.calls, pause))
            print(f"round {k + 1} done", file=sys.stderr)
    finally:
        stop(procs, conn, prefix)
    result = {
        "pauses": {
            str(p): {
                "n": len(v),
                "p50_ms": round(1000 * percentile(v, 0.5), 1),
                "p99_ms": round(1000 * percentile(v, 0.99), 1),
            }
            for p, v in by_pause.items()
        },
        "logs": workdir,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
