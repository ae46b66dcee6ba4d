"""Host time of one decode step: the engine's Python work around the model's forward.

On a GPU with CUDA graphs, a decode step's forward is one graph replay (~0.5 ms
on an H200); everything else the step does runs on the host: schedule, pack the
batch, sample, detokenize, stop checks, RequestOutputs. This benchmark measures
that host work on the CPU with a tiny random-weight Llama (2 layers, hidden 64,
vocab 512, the tests' byte-level BPE tokenizer), so the forward is small, and
subtracts the forward itself.

Workload: ``--batch`` sequences (default 64 and 256) of 32 random prompt tokens,
all past prefill and decoding, greedy (``--temperature`` T: sampled), one a request
(``--n`` N: batch / N requests of N samples each, forked), no logprobs, ``ignore_eos``,
DELTA outputs (as the worker asks for them, ``worker.held.engine_params``). Per decode
step:

  wall      the whole ``engine.step()``
  forward   ``ModelRunner.execute``: the forward that a GPU replays as one graph
  plan      the CPU attention's plan (``AttentionPlan.build``, inside ``prepare``):
            CPU-only work that the GPU's attention kernel does itself, so it
            counts with the forward, not as host time
  argmax    the greedy path's argmax and finite check (``sampler.finite_argmax``,
            queued right after the forward): device work on a GPU, so it counts
            with the forward; 0 on a side without that path (its argmax runs in
            ``sample``, its finite check in ``rest``)
  host      wall - forward - plan - argmax: the target of issue 47 item 4 is this
            number (<= 0.5 of today's at batch 64 and 256)
  host_cpu  the same in this thread's CPU time (torch runs on 1 thread), which the
            other users of a shared machine disturb far less than the wall clock
  schedule, prepare (without plan), sample (``Sampler.__call__``), rest (all else:
            logits bookkeeping, detokenize, stop checks, RequestOutputs)

Phases are timed by wrapping those callables on the engine; a phase that the
code under test no longer calls reads 0 and its work lands in ``rest``.

Base against head in alternated runs (A B A B ...), each run in a fresh process,
so that drift and the other users of the machine fall on both sides. The base
side imports lorapool from ``git archive BASE`` of this checkout (put first on
PYTHONPATH, ahead of the editable install); the head side, from this checkout.

    python benchmarks/host_step.py                        # head only, one run
    python benchmarks/host_step.py --base 14f63a1 --pairs 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN = 32
VOCAB = 512
# top-level folders that pyproject maps into the lorapool namespace
MAPPED = ["engine", "kernels", "worker", "producer", "audit_db", "gateway"]
REPORTED = (
    "host",
    "host_cpu",
    "wall",
    "forward",
    "plan",
    "argmax",
    "schedule",
    "prepare",
    "sample",
    "rest",
)


def build_model(path: Path) -> str:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from tiny_models import build_tiny_model
    from tiny_tokenizer import build_tiny_tokenizer

    build_tiny_model("llama", path, vocab_size=VOCAB)
    build_tiny_tokenizer(path, vocab_size=VOCAB)
    return str(path)


def decoding_engine(model: str, batch: int, num_steps: int, temperature: float = 0.0, n: int = 1):
    """An engine whose ``batch`` sequences (``batch / n`` requests of ``n`` samples) are
    all past prefill, outliving the steps to come."""
    from lorapool import EngineArgs, LLMEngine, SamplingParams
    from lorapool.protocol import RequestOutputKind

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT_LEN)
    )
    params = SamplingParams(
        temperature=temperature,
        n=n,
        max_tokens=num_steps + 16,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    rng = random.Random(0)
    for i in range(batch // n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    return engine


class Phases:
    """Seconds spent in each wrapped callable since the last ``take``: wall clock, and
    this thread's CPU time under ``NAME_cpu``."""

    def __init__(self):
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, fn):
        self.spent[name] = self.spent[f"{name}_cpu"] = 0.0

        def timed(*args, **kwargs):
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[f"{name}_cpu"] += time.thread_time() - start_cpu
                self.spent[name] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        spent = dict(self.spent)
        for name in self.spent:
            self.spent[name] = 0.0
        return spent


def instrument(engine) -> Phases:
    from lorapool import kernels
    from lorapool.engine import llm_engine

    phases = Phases()
    engine.scheduler.schedule = phases.wrap("schedule", engine.scheduler.schedule)
    engine.runner.prepare = phases.wrap("prepare", engine.runner.prepare)
    engine.runner.execute = phases.wrap("forward", engine.runner.execute)
    engine.sampler = phases.wrap("sample", engine.sampler)
    build = kernels.AttentionPlan.build
    kernels.AttentionPlan.build = phases.wrap("plan", build)
    phases.wrap("argmax", None)  # 0 where the engine has no greedy path
    if hasattr(llm_engine, "finite_argmax"):
        llm_engine.finite_argmax = phases.wrap("argmax", llm_engine.finite_argmax)
    return phases


def measure(model: str, batch: int, num_steps: int, temperature: float = 0.0, n: int = 1) -> dict:
    engine = decoding_engine(model, batch, num_steps, temperature, n)
    phases = instrument(engine)
    steps = []
    for _ in range(num_steps):
        phases.take()
        start, start_cpu = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        wall_cpu = time.thread_time() - start_cpu
        wall = time.perf_counter() - start
        advanced = sum(len(o.outputs) for o in outputs)
        assert advanced == batch, f"a step advanced {advanced} of {batch} sequences"
        spent = phases.take()
        spent["prepare"] -= spent["plan"]
        spent["wall"] = wall
        device = ("forward", "plan", "argmax")
        spent["host"] = wall - sum(spent[k] for k in device)
        spent["host_cpu"] = wall_cpu - sum(spent[f"{k}_cpu"] for k in device)
        spent["rest"] = spent["host"] - spent["schedule"] - spent["prepare"] - spent["sample"]
        steps.append(spent)
    return {name: round(statistics.median(s[name] for s in steps) * 1e3, 3) for name in REPORTED}


def run_once(args) -> dict:
    import torch

    torch.set_num_threads(1)
    from lorapool import engine

    result = {"engine": str(Path(engine.__file__).parent)}
    for batch in args.batch:
        result[str(batch)] = measure(args.model, batch, args.steps, args.temperature, args.n)
    return result


def base_tree(rev: str, root: Path) -> Path:
    """``rev`` of this checkout laid out as an importable ``lorapool`` package under root."""
    src = root / "src"
    src.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = root / "pkg"
    pkg.mkdir()
    (pkg / "lorapool").symlink_to(src / "lorapool")
    for name in MAPPED:
        (src / "lorapool" / name).symlink_to(src / name)
    return pkg


def child(args, side: str, pythonpath: Path | None) -> dict:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    cmd = [sys.executable, __file__, "--once", "--model", args.model, "--steps", str(args.steps)]
    cmd += ["--batch", *map(str, args.batch), "--temperature", str(args.temperature)]
    cmd += ["--n", str(args.n)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    print(side, json.dumps(result), file=sys.stderr, flush=True)
    return result


def alternate(args, root: Path) -> dict:
    pkg = base_tree(args.base, root) if args.base else None
    sides = {"base": [], "head": []} if pkg else {"head": []}
    for _ in range(args.pairs):
        for side in sides:
            sides[side].append(child(args, side, pkg if side == "base" else None))
    summary = {"base_rev": args.base, "pairs": args.pairs, "steps": args.steps}
    summary |= {"temperature": args.temperature, "n": args.n}
    for batch in map(str, args.batch):
        row = {}
        for side, runs in sides.items():
            keys = runs[0][batch]
            row[side] = {k: round(statistics.median(r[batch][k] for r in runs), 3) for k in keys}
            row[side]["host_runs"] = [r[batch]["host"] for r in runs]
            row[side]["host_cpu_runs"] = [r[batch]["host_cpu"] for r in runs]
        if pkg:  # medians over runs; "best": the least run of each side (noise only adds)
            row["host_head_vs_base"] = round(row["head"]["host"] / row["base"]["host"], 3)
            best = {side: min(row[side]["host_runs"]) for side in sides}
            row["best_host_head_vs_base"] = round(best["head"] / best["base"], 3)
            row["host_cpu_head_vs_base"] = round(
                row["head"]["host_cpu"] / row["base"]["host_cpu"], 3
            )
            row["wall_head_vs_base"] = round(row["head"]["wall"] / row["base"]["wall"], 3)
        summary[batch] = row
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="git rev of the base side (omit: head only)")
    parser.add_argument("--pairs", type=int, default=3, help="alternated runs per side")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=30, help="measured decode steps per run")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (argmax)")
    parser.add_argument("--n", type=int, default=1, help="samples a request (batch / n requests)")
    parser.add_argument("--model", help="a model directory (default: a tiny Llama, built)")
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        print(json.dumps(run_once(args)))
        return
    with tempfile.TemporaryDirectory(prefix="lorapool-host-step-") as tmp:
        root = Path(tmp)
        args.model = args.model or build_model(root / "model")
        summary = alternate(args, root)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
