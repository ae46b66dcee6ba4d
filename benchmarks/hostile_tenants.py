"""One tenant against the others: a light tenant's latency alone, then while a hostile
tenant does the worst of issue 51's rows 1-5, over a real ``lorapool serve`` and a real
``lorapool worker`` (SmolLM2 on this machine's device), each tenant with its own key.

The light tenant sends one chat completion of ``max_tokens=1`` at a time, every
``--pause`` seconds (0.1: some 130 calls a 15 s phase, so that a p99 is not a phase's
slowest call, as it was of 30 at 0.5). The hostile tenant, in the attacked phase, runs each of
``--attacks`` in a loop at once:

- ``ref_chain``: a json_schema whose ``$ref`` chain has 3,000 ``$defs`` (row 1; it
  crashed llguidance inside the gateway);
- ``lark_chain``: a Lark grammar chain of 3,000 rules in ``guided_grammar`` (row 1);
- ``gbnf``: a GBNF grammar of 1,000 rules (row 2: compiled on the event loop, then
  again in the worker);
- ``tokenize``: ``/tokenize`` with a 6 MB prompt, 4 at once (row 3);
- ``n64``: completions of ``n=64, max_tokens=30``, 2 in flight (row 4);
- ``streams``: ``--streams`` job-event streams held open (row 5).

Reported: the light tenant's p50/p99 latency alone and attacked, their ratios (target
<= 2), its failed calls, the hostile tenant's answers by status, and whether the
gateway and the worker were still up at the end. Phases alternate ``--rounds`` times
(alone, attacked, ...) so a noisy machine hits both alike.

    lorapool bench hostile_tenants [--seconds 40] [--rounds 2] [--attacks n64,gbnf]
                                   [--heavy-rpm 600] [--attacker-nice 10]
                                   [--json out.json]

``--heavy-rpm``: the hostile tenant's key carries that rate limit (a plain key has none).
The hostile tenant runs in a process of its own; ``--attacker-nice N`` lowers it in the
OS's scheduler, to stand for an attacker on another machine when the box is small;
``--worker-cpus 0 --other-cpus 1`` gives the worker a CPU of its own and the rest the
others, to stand for the worker's own (GPU) machine; ``--attacker-cpus`` places the
attacking process apart from the gateway's (on a small box, with the worker).
``--paced-forward 3,5,10`` runs the worker's forward as a GPU's sleep (step ms, µs a
decode token, µs a prefill position; ``benchmarks/_paced_forward.py``): the rest of the
worker, the scheduler's fair share and the host's part of a step, runs for real, on this
box's CPU, while a batch's forward costs what it would on the device; with
``--queued-device`` the device is one the host queues work on, as a GPU's (the host waits
only when it reads a step back, ``_paced_forward.QueuedDevice``).

Redis: ``--redis-url``, else ``$REDIS_URL``, else 127.0.0.1:6379/0.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as `lorapool bench` runs it too

from hostile_attacks import ATTACKS, attacker  # noqa: E402

AUDIT_KEY = "bench-hostile-tenants-audit-key-0123456789"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def light_client(url: str, headers: dict, model: str, end: float, pause: float) -> dict:
    import httpx

    latencies, failures = [], Counter()
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    async with httpx.AsyncClient() as http:
        while time.monotonic() < end:
            start = time.monotonic()
            try:
                reply = await http.post(
                    url + "/v1/chat/completions", json=body, headers=headers, timeout=300
                )
                if reply.status_code == 200:
                    latencies.append(time.monotonic() - start)
                else:
                    failures[str(reply.status_code)] += 1
            except Exception as error:  # noqa: BLE001
                failures[type(error).__name__] += 1
            await asyncio.sleep(pause)
    return {"latencies": latencies, "failures": dict(failures)}


async def phase(args, url: str, keys: dict, model: str, attacks: list[str]) -> dict:
    if not attacks:
        end = time.monotonic() + args.seconds
        return {**await light_client(url, keys["light"], model, end, args.pause), "hostile": {}}
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    hostile = (theirs, url, keys["heavy"], model, args.streams, attacks, args.attacker_nice)
    proc = context.Process(target=attacker, args=hostile, daemon=True)
    proc.start()
    if args.attacker_cpus:
        os.sched_setaffinity(proc.pid, args.attacker_cpus)
    try:
        if not mine.poll(120) or mine.recv() != "ready":
            raise SystemExit("the attacking process did not start")
        end = time.monotonic() + args.seconds
        mine.send(end)
        light = await light_client(url, keys["light"], model, end, args.pause)
        answers = mine.recv() if mine.poll(args.seconds + 120) else {"attacker lost": 1}
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return {**light, "hostile": answers}


def _cpus(text: str) -> set[int]:
    return {int(c) for c in text.split(",") if c}


def _paced(text: str) -> tuple[str, str, str]:
    parts = text.split(",")
    if len(parts) != 3 or not all(0 <= float(p) < 1e6 for p in parts):  # NaN fails too
        raise argparse.ArgumentTypeError(f"want STEP_MS,TOKEN_US,PREFILL_US, got {text!r}")
    return tuple(parts)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args, prefix: str, workdir: str) -> tuple[list, str]:
    env = os.environ | {"LORAPOOL_AUDIT_KEY": AUDIT_KEY}
    lorapool = [sys.executable, "-c", "from lorapool.cli.main import main; main()"]
    port = free_port()
    common = ["--prefix", prefix, "--redis-url", args.redis_url]
    runner = lorapool
    if args.paced_forward:  # the engine's forward a GPU's sleep (benchmarks/_paced_forward.py)
        step, token, prefill = args.paced_forward
        paced = str(Path(__file__).resolve().parent / "_paced_forward.py")
        runner = [sys.executable, paced, "--step-ms", step, "--token-us", token]
        runner += ["--prefill-us", prefill, *(["--queued"] if args.queued_device else []), "--"]
    worker = [*runner, "worker", "--model", args.model, *common, "--name", "bench-hostile"]
    worker += args.worker_arg
    gateway = [*lorapool, "serve", "--port", str(port), *common, *args.gateway_arg]
    procs = []
    for name, cmd in (("worker", worker), ("gateway", gateway)):
        cpus = args.worker_cpus if name == "worker" else None  # the gateway: this process's
        place = functools.partial(os.sched_setaffinity, 0, cpus) if cpus else None
        with open(os.path.join(workdir, f"{name}.log"), "wb") as log:
            out = {"stdout": log, "stderr": subprocess.STDOUT}
            procs.append(subprocess.Popen(cmd, env=env, cwd=workdir, preexec_fn=place, **out))
    return procs, f"http://127.0.0.1:{port}"


def stop(procs: list, conn, prefix: str) -> None:
    """The worker and the gateway stopped (killed past 30 s) and the pool's keys gone."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    for key in conn.scan_iter(match=f"{prefix}:*", count=1000):
        conn.delete(key)


def wait_ready(url: str, procs: list, headers: dict, timeout: float = 300.0) -> str:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit("the worker or the gateway exited while starting (see their logs)")
        try:
            models = httpx.get(url + "/v1/models", headers=headers, timeout=5).json()["data"]
            if models:
                return models[0]["id"]
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1)
    raise SystemExit("the pool did not come up")


def summary(rounds: list[dict]) -> dict:
    alone = [x for r in rounds for x in r["alone"]["latencies"]]
    attacked = [x for r in rounds for x in r["attacked"]["latencies"]]
    out = {"alone_n": len(alone), "attacked_n": len(attacked)}
    for name, values in (("alone", alone), ("attacked", attacked)):
        out[f"{name}_p50_s"] = round(percentile(values, 0.5), 3)
        out[f"{name}_p99_s"] = round(percentile(values, 0.99), 3)
    for q in ("p50", "p99"):
        out[f"ratio_{q}"] = round(out[f"attacked_{q}_s"] / out[f"alone_{q}_s"], 2)
    # in call order, a list a phase: a burst at an attack's start shows as its first calls
    out["attacked_latencies_ms"] = [
        [round(x * 1000, 1) for x in r["attacked"]["latencies"]] for r in rounds
    ]
    out["light_failures"] = Counter()
    out["hostile_answers"] = Counter()
    for r in rounds:
        out["light_failures"].update(r["attacked"]["failures"])
        out["hostile_answers"].update(r["attacked"]["hostile"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pause", type=float, default=0.1)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--heavy-rpm",
        type=int,
        default=None,
        help="the hostile tenant's key's requests a minute (default: none, as a plain key)",
    )
    parser.add_argument(
        "--attacker-nice",
        type=int,
        default=0,
        help="the attacking process's niceness: >0 stands for a client on another machine",
    )
    parser.add_argument(
        "--worker-cpus",
        type=_cpus,
        default=None,
        help="CPUs for the worker alone (e.g. 0), to stand for its GPU machine on a small box",
    )
    parser.add_argument(
        "--other-cpus",
        type=_cpus,
        default=None,
        help="CPUs for the gateway, both tenants' clients and this process (e.g. 1)",
    )
    parser.add_argument(
        "--attacker-cpus",
        type=_cpus,
        default=None,
        help="CPUs for the attacking process (default: those of --other-cpus), e.g. 0: it "
        "does not take the gateway's CPU, as a client on another machine would not",
    )
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="an option for the worker (repeatable), e.g. --worker-arg=--no-tenant-fair-share",
    )
    parser.add_argument(
        "--paced-forward",
        type=_paced,
        default=None,
        metavar="STEP_MS,TOKEN_US,PREFILL_US",
        help="the worker's forward a sleep at a GPU's step rate (benchmarks/_paced_forward.py; "
        "e.g. 3,5,10 for a ~1B Llama on an H200): the pool's queue speed without a device",
    )
    parser.add_argument(
        "--queued-device",
        action="store_true",
        help="with --paced-forward: the host queues the forward and waits at its read-back",
    )
    parser.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="an option for the gateway (repeatable), e.g. --gateway-arg=--turns-per-tenant=0",
    )
    args = parser.parse_args()
    attacks = [a for a in args.attacks.split(",") if a]
    if unknown := set(attacks) - set(ATTACKS):
        parser.error(f"unknown attacks {sorted(unknown)}; have {', '.join(ATTACKS)}")
    if args.model is None:
        from lorapool.settings import smollm2_dir

        args.model = str(smollm2_dir())

    import redis

    from lorapool.lifecycle.keys import Keys
    from lorapool.producer.api_keys import ApiKeys

    if args.other_cpus:  # the gateway and the attacking process inherit it
        os.sched_setaffinity(0, args.other_cpus)
    prefix = f"bench-hostile-{uuid.uuid4().hex[:8]}"
    conn = redis.Redis.from_url(args.redis_url)
    store = ApiKeys(conn, Keys(prefix))
    limits = {"heavy": {"rpm": args.heavy_rpm} if args.heavy_rpm else {}, "light": {}}
    keys = {
        t: {"Authorization": f"Bearer {store.add(t, 'submit', **limits[t])[1]}"}
        for t in ("light", "heavy")
    }
    workdir = tempfile.mkdtemp(prefix="bench-hostile-")
    procs, url = start(args, prefix, workdir)
    try:
        model = wait_ready(url, procs, keys["light"])
        # the pool's first calls load the tokenizer, the chat template, the engine's
        # first shapes (5 s for the first): not what either phase measures
        asyncio.run(light_client(url, keys["light"], model, time.monotonic() + 3, 0.1))
        rounds = []
        for k in range(args.rounds):
            alone = asyncio.run(phase(args, url, keys, model, []))
            attacked = asyncio.run(phase(args, url, keys, model, attacks))
            rounds.append({"alone": alone, "attacked": attacked})
            print(f"round {k + 1}: alone {len(alone['latencies'])} calls, attacked "
                  f"{len(attacked['latencies'])}", file=sys.stderr)  # fmt: skip
        result = summary(rounds)
        result["up_at_end"] = {
            "worker": procs[0].poll() is None,
            "gateway": procs[1].poll() is None,
        }
        result |= {"attacks": attacks, "seconds": args.seconds, "rounds": args.rounds}
        result["heavy_rpm"] = args.heavy_rpm
        result["attacker_nice"] = args.attacker_nice
        result["paced_forward"] = args.paced_forward
        result["queued_device"] = args.queued_device
        result["worker_args"] = args.worker_arg
        cpus = {"worker": args.worker_cpus, "other": args.other_cpus}
        cpus["attacker"] = args.attacker_cpus or args.other_cpus
        result["cpus"] = {k: sorted(v or ()) for k, v in cpus.items()}
        result["logs"] = workdir
    finally:
        stop(procs, conn, prefix)
    print(json.dumps(result, indent=2, default=dict))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2, default=dict)


if __name__ == "__main__":
    main()
