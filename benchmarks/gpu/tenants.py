"""Section 8 (part 3): issue 51's hostile tenant, with the worker on the device.

``benchmarks/hostile_tenants.py`` (``lorapool bench hostile_tenants``) as it runs on a
CPU box, here with what a 2-core box cannot have: the worker on its GPU and CPUs of its
own, the gateway and both tenants' clients on the others, the attacker at full priority.
A real ``lorapool serve`` and ``lorapool worker`` on the carried server; a light tenant
sends one-token chats, alone and then while a hostile tenant (a process of its own)
sends the worst of issue 51's rows 1-5 (refused grammars and schemas, 6 MB
``/tokenize`` bodies, ``n=64`` floods, held event streams), in alternating phases.

Figures: the light tenant's p50 / p99 alone and attacked and their ratios
(``acceptance_light_ratio_p50`` / ``_p99``: issue 51 accepts within 2), the hostile
tenant's answers by status, the CPUs each side had. Checks: no light call failed, no
attack got a 5xx, the gateway and the worker were up at the end. The model is the
engine section's first shape (random weights) with a ChatML template, so chats render.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from . import models, oracle
from .server import Server, find_binary

BENCH = Path(__file__).resolve().parents[1] / "hostile_tenants.py"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def run(ctx, rec) -> None:
    sizes = ctx.sizes
    root = Path(ctx.workdir) / "models"
    path, hf = models.build_model(sizes.models[0], root, ctx.device, load=False)
    del hf  # the worker loads its own: a model built now is dropped, one on disk not loaded
    oracle.free()
    _add_chat_template(path)
    binary = find_binary()
    if not rec.check("a server binary is installed", binary is not None, "see make gpu-wheels"):
        return
    server = Server(binary)
    try:
        _bench(ctx, rec, server, path)
    finally:
        server.stop()


def _add_chat_template(path: Path) -> None:
    config = path / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = CHATML
    config.write_text(json.dumps(data))


def placement(cpus: list[int]) -> tuple[list[int], list[int]] | None:
    """The worker's CPUs and the others' of ``cpus`` (this process's, as a container
    numbers them): a quarter (at least two) for the worker, the rest for the gateway and
    the clients; None under 8."""
    if len(cpus) < 8:
        return None
    worker = max(2, len(cpus) // 4)
    return cpus[:worker], cpus[worker:]


def _bench(ctx, rec, server: Server, path: Path) -> None:
    sizes, out = ctx.sizes, Path(ctx.workdir) / "tenants.json"
    cmd = [sys.executable, str(BENCH), "--model", str(path), "--redis-url", server.url]
    cmd += ["--seconds", str(sizes.tenants_seconds), "--rounds", str(sizes.tenants_rounds)]
    cmd += ["--streams", str(sizes.tenants_streams), "--json", str(out)]
    cmd += [f"--worker-arg=--device={ctx.device}"]
    if ctx.device != "cuda":
        cmd += [f"--worker-arg=--kv-cache-memory={64 << 20}"]
    placed = placement(sorted(os.sched_getaffinity(0)))
    if placed:
        worker, others = placed
        cmd += ["--worker-cpus", ",".join(map(str, worker))]
        cmd += ["--other-cpus", ",".join(map(str, others))]
    rec.figure("worker_cpus", len(placed[0]) if placed else "shared")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    log = Path(ctx.workdir) / "tenants.log"
    with open(log, "w") as sink:  # cwd outside the checkout: its folders would shadow lorapool
        proc = subprocess.run(
            cmd, cwd=ctx.workdir, env=env, stdout=sink, stderr=subprocess.STDOUT,
            timeout=max(1.0, ctx.time_left()),
        )  # fmt: skip
    tail = log.read_text()[-1500:]
    if not rec.check("the bench ran to its end", proc.returncode == 0 and out.exists(), tail):
        return
    _record(rec, json.loads(out.read_text()))


def _record(rec, result: dict) -> None:
    for key in ("alone_p50_s", "alone_p99_s", "attacked_p50_s", "attacked_p99_s"):
        rec.figure(key, result[key])
    rec.figure("acceptance_light_ratio_p50", result["ratio_p50"])
    rec.figure("acceptance_light_ratio_p99", result["ratio_p99"])
    rec.figure("light_calls", {"alone": result["alone_n"], "attacked": result["attacked_n"]})
    # in call order a phase: a burst as an attack starts (500 streams opened at once took
    # the gateway ~1 s on a 2-core CPU box) shows apart from a steady slowdown
    rec.figure("attacked_latencies_ms", result["attacked_latencies_ms"])
    answers = result["hostile_answers"]
    rec.figure("hostile_answers", answers)
    failures = result["light_failures"]
    rec.check("no light call failed", not failures, json.dumps(failures))
    errors = {k: n for k, n in answers.items() if k.rsplit(" ", 1)[-1].startswith("5")}
    rec.check("no attack got a 5xx", not errors, json.dumps(errors))
    up = result["up_at_end"]
    rec.check("the gateway and the worker were up at the end", all(up.values()), json.dumps(up))
