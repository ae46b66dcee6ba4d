"""What one refused call of the hostile tenant costs the gateway: its CPU time (from
/proc) per call, for each body of ``hostile_tenants`` with a plain key and with a key
whose minute is spent (rpm=1: every call after the first is a 429).

    python benchmarks/refusal_cost.py [--model DIR] [--calls 40]

A real ``lorapool serve`` and ``lorapool worker`` (``hostile_tenants.start``); Redis:
``--redis-url``, else ``$REDIS_URL``, else 127.0.0.1:6379/0. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostile_tenants as hostile  # noqa: E402
from hostile_attacks import Hostile  # noqa: E402

KINDS = ("tokenize", "ref_chain", "gbnf", "lark_chain")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    if args.model is None:
        from lorapool.settings import smollm2_dir

        args.model = str(smollm2_dir())
    args.worker_arg, args.worker_cpus = [], None
    import httpx
    import redis

    from lorapool.lifecycle.keys import Keys
    from lorapool.producer.api_keys import ApiKeys

    prefix = f"bench-refusal-{uuid.uuid4().hex[:8]}"
    conn = redis.Redis.from_url(args.redis_url)
    store = ApiKeys(conn, Keys(prefix))
    keys = {
        "plain": store.add("plain", "submit")[1],
        "spent (rpm=1)": store.add("spent", "submit", rpm=1)[1],
    }
    procs, url = hostile.start(args, prefix, tempfile.mkdtemp(prefix="bench-refusal-"))
    try:
        model = hostile.wait_ready(url, procs, {"Authorization": f"Bearer {keys['plain']}"})
        bodies = Hostile(url, {}, model, 1).encoded
        plain = {"Authorization": f"Bearer {keys['plain']}"}
        deadline = time.monotonic() + 120  # the worker publishes its tokenizer after /v1/models
        while httpx.post(url + "/tokenize", json={"prompt": "a"}, headers=plain).status_code != 200:
            if time.monotonic() > deadline:
                raise SystemExit("/tokenize did not answer 200 in 120 s")
            time.sleep(1)
        gateway = procs[1].pid
        print("| body | key | answers | gateway CPU ms a call | wall ms a call |")
        print("|---|---|---|---:|---:|")
        with httpx.Client(timeout=60) as http:
            for kind in KINDS:
                path, body = bodies[kind]
                for name, key in keys.items():
                    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
                    http.post(url + path, content=body, headers=headers)  # spends rpm=1
                    answers, cpu, wall = {}, cpu_s(gateway), time.perf_counter()
                    for _ in range(args.calls):
                        status = http.post(url + path, content=body, headers=headers).status_code
                        answers[status] = answers.get(status, 0) + 1
                    cpu = (cpu_s(gateway) - cpu) / args.calls * 1000
                    wall = (time.perf_counter() - wall) / args.calls * 1000
                    print(f"| {kind} | {name} | {answers} | {cpu:.1f} | {wall:.1f} |", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        for key in conn.scan_iter(match=f"{prefix}:*", count=1000):
            conn.delete(key)


if __name__ == "__main__":
    main()
