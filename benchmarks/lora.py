"""Multi-LoRA benchmark: the engine benchmark's workload with adapters (issue 3).

Sides, SmolLM2 on the CPU by default:
  base     the base model only, on an engine started with enable_lora=True
  lora16   16 distinct adapters, requests spread uniformly, max_loras=16
  skewed   200 registered adapters, max_loras=8, max_cpu_loras=32, adapter k
           picked with weight 1.5^-k (each 1.5x as popular as the next)
  peft     PEFT's mixed-adapter generate (``adapter_names=``) over the same 16
           adapters, batches of 16, left-padded (as benchmarks/engine.py does)

All sides run in one subprocess, in lockstep, each side's clock counting only
its own work. This machine's speed drifts by 10-20% from minute to minute
(other tenants), enough to swing the ratio of two runs made one after the
other from 0.72 to 0.90 (and lora16 against a PEFT run made before it from
3.6x to 4.3x); in lockstep, the sides see the same drift. The engines take a
step each in turn. PEFT's generate calls its streamer after every step; there,
every 5 s of PEFT's own time, the engines are stepped until their share of
output tokens catches up with PEFT's share of generate steps, so all sides
cross the run at the same pace.

Adapters: rank 16 on all seven projections, random weights written directly
as PEFT files. The 200 adapters of ``skewed`` are 200 directories (200 ids and
paths) sharing 16 distinct weight files by hard link, to keep the disk use at
16 adapters' worth; every load still reads and hashes its file.

    python benchmarks/lora.py [--model DIR] [--requests 64] [--sides base,lora16,peft,skewed]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 16


def _engine_bench():
    spec = importlib.util.spec_from_file_location(
        "engine_bench", Path(__file__).with_name("engine.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_adapters(model: str, root: Path, num_distinct: int, num_dirs: int) -> list[str]:
    """``num_dirs`` adapter directories over ``num_distinct`` weight files (hard links)."""
    from lorapool.cli.demo_adapters import write_adapter

    distinct = [
        write_adapter(model, root / f"distinct-{i}", RANK, tuple(TARGETS), seed=i)
        for i in range(num_distinct)
    ]
    dirs = []
    for i in range(num_dirs):
        source, path = distinct[i % num_distinct], root / f"lora-{i}"
        path.mkdir()
        shutil.copyfile(source / "adapter_config.json", path / "adapter_config.json")
        os.link(source / "adapter_model.safetensors", path / "adapter_model.safetensors")
        dirs.append(str(path))
    return dirs


def pick_adapters(side: str, num_requests: int, dirs: list[str]) -> list[int | None]:
    if side == "base":
        return [None] * num_requests
    if side in ("lora16", "peft"):
        return [i % 16 for i in range(num_requests)]
    weights = [1.5**-k for k in range(len(dirs))]
    return random.Random(1).choices(range(len(dirs)), weights=weights, k=num_requests)


ENGINE_SIDES = ("base", "lora16", "skewed")


def make_engine(side: str, model: str, workload, dirs):
    """An engine for ``side`` with the workload's requests and adapters: (engine, params, loras)."""
    from lorapool import EngineArgs, LLMEngine, LoRARequest, SamplingParams

    loras = dict(max_loras=8, max_cpu_loras=32) if side == "skewed" else dict(max_loras=16)
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            enable_lora=True,
            max_lora_rank=RANK,
            **loras,
        )
    )
    picks = pick_adapters(side, len(workload), dirs)
    loras = [None if k is None else LoRARequest(f"lora-{k}", k + 1, dirs[k]) for k in picks]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    return engine, params, loras


class EngineSides:
    """The engine sides stepped in turn, one step each a round; each side's clock
    counts only its own steps."""

    def __init__(self, sides: list[str], model: str, workload, dirs):
        self.engines = {}
        for side in sides:
            engine, params, loras = make_engine(side, model, workload, dirs)
            for i, ((prompt, _), p, lora) in enumerate(zip(workload, params, loras)):
                engine.add_request(str(i), {"prompt_token_ids": prompt}, p, lora_request=lora)
            self.engines[side] = engine
        self.sides = list(sides)
        self.total = len(sides) * sum(n for _, n in workload)
        self.clock = dict.fromkeys(sides, 0.0)
        self.first_token = {side: {} for side in sides}
        self.emitted = {side: {} for side in sides}  # request id -> tokens so far

    def unfinished(self) -> bool:
        return bool(self.engines)

    def progress(self) -> float:
        """The share of all sides' output tokens produced so far."""
        return sum(sum(e.values()) for e in self.emitted.values()) / self.total

    def round(self) -> None:
        for side, engine in list(self.engines.items()):
            start = time.perf_counter()
            outputs = engine.step()
            self.clock[side] += time.perf_counter() - start
            for out in outputs:
                if out.outputs[0].token_ids:
                    self.first_token[side].setdefault(out.request_id, self.clock[side])
                self.emitted[side][out.request_id] = len(out.outputs[0].token_ids)
            if not engine.has_unfinished_requests():
                del self.engines[side]
                print(f"  {side}: done, {self.clock[side]:.1f}s", file=sys.stderr, flush=True)

    def results(self, bench) -> dict:
        results = {}
        for side in self.sides:
            ttfts = list(self.first_token[side].values())
            tokens = sum(self.emitted[side].values())  # every request has finished
            results[side] = bench.summary(tokens, self.clock[side], ttfts)
            del results[side]["peak_rss_mib"]  # the process holds every side
        return results


# PEFT hands its turn to the engines once per this many seconds of its own
# time. Each hand-over leaves the side that resumes with cold caches: handing
# over after every step (PEFT's steps are small and Python-bound) slowed PEFT
# by a tenth while the engines' times did not move.
SLICE_S = 5.0


class PeftStreamer:
    """generate()'s streamer for one PEFT batch: notes on ``clock`` when the
    batch's first tokens exist and calls ``after_step(steps so far)`` after
    every step."""

    def __init__(self, clock, after_step):
        self.steps = -1  # put() comes once with the prompt, then once a step
        self.clock = clock
        self.after_step = after_step
        self.first_token = None

    def put(self, value) -> None:
        self.steps += 1
        if self.steps == 1:
            self.first_token = self.clock()
        if self.steps >= 1:
            self.after_step(self.steps)

    def end(self) -> None:
        pass


def run_peft(model: str, workload, dirs, engines: EngineSides | None, batch_size: int = 16):
    """PEFT's mixed-adapter generate over the workload; every ``SLICE_S`` of
    PEFT's time, the engines (if any) are stepped until their share of output
    tokens catches up with PEFT's share of generate steps. PEFT's summary."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    bench = _engine_bench()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(hf, dirs[0], adapter_name="lora-0")
    for k in range(1, 16):
        peft.load_adapter(dirs[k], adapter_name=f"lora-{k}")
    pad = bench.pad_token_id(hf)
    picks = pick_adapters("peft", len(workload), dirs)
    batches = [workload[b : b + batch_size] for b in range(0, len(workload), batch_size)]
    total_steps = sum(max(n for _, n in batch) for batch in batches)
    start = time.perf_counter()
    steps_done, elsewhere, handed_over = 0, 0.0, 0.0  # elsewhere: seconds in engine steps

    def own_clock() -> float:
        return time.perf_counter() - start - elsewhere

    def after_step(batch_steps: int) -> None:
        nonlocal elsewhere, handed_over
        if engines is None or own_clock() - handed_over < SLICE_S:
            return
        handed_over, turn = own_clock(), time.perf_counter()
        target = (steps_done + batch_steps) / total_steps
        while engines.unfinished() and engines.progress() < target:
            engines.round()
        elsewhere += time.perf_counter() - turn

    ttfts, tokens = [], 0
    for b, batch in enumerate(batches):
        ids, mask, max_new = bench.padded_batch(batch, pad)
        streamer, first = PeftStreamer(own_clock, after_step), b * batch_size
        with torch.inference_mode():
            peft.generate(
                input_ids=ids,
                adapter_names=[f"lora-{k}" for k in picks[first : first + len(batch)]],
                **bench.greedy_exactly(max_new, mask, pad, streamer),
            )
        ttfts += [streamer.first_token] * len(batch)
        steps_done += max_new
        tokens += sum(n for _, n in batch)
        bench.progress(first + len(batch), len(workload), start + elsewhere)
    return bench.summary(tokens, own_clock(), ttfts)


def run_sides(sides: list[str], model: str, workload, dirs, threads: int) -> dict:
    """Every side in one process, in lockstep (see the module doc); a summary per side."""
    import torch

    torch.set_num_threads(threads)
    bench = _engine_bench()
    engine_sides = [side for side in sides if side in ENGINE_SIDES]
    engines = EngineSides(engine_sides, model, workload, dirs) if engine_sides else None
    results = {}
    if "peft" in sides:
        results["peft"] = run_peft(model, workload, dirs, engines)
        print(f"  peft: done, {results['peft']['seconds']:.1f}s", file=sys.stderr, flush=True)
    while engines and engines.unfinished():
        engines.round()
    if engines:
        results.update(engines.results(bench))
    results["peak_rss_mib"] = round(bench.peak_rss_mib(), 1)
    return results


def run_child(args, adapter_root: str) -> dict:
    """Runs the sides in a fresh interpreter."""
    cmd = [
        sys.executable,
        __file__,
        "--side",
        args.sides,
        "--model",
        args.model,
        "--requests",
        str(args.requests),
        "--threads",
        str(args.threads),
        "--adapter-root",
        adapter_root,
    ]
    result = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def ratios(results: dict) -> dict:
    tps = {side: r["output_tokens_per_s"] for side, r in results.items() if isinstance(r, dict)}
    out = {}
    if "base" in tps:
        out.update(
            {
                f"{side}_vs_base": round(tps[side] / tps["base"], 2)
                for side in ("lora16", "skewed")
                if side in tps
            }
        )
    if "lora16" in tps and "peft" in tps:
        out["lora16_vs_peft"] = round(tps["lora16"] / tps["peft"], 2)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sides", default="base,lora16,peft,skewed")
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--adapter-root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.model is None:
        from lorapool.settings import smollm2_dir

        args.model = str(smollm2_dir())
    if args.side:
        return _child(args)
    unknown = set(args.sides.split(",")) - {*ENGINE_SIDES, "peft"}
    if unknown:
        parser.error(f"unknown sides {sorted(unknown)}; known: {', '.join(ENGINE_SIDES)}, peft")
    with tempfile.TemporaryDirectory(prefix="lorapool-bench-lora-") as root:
        write_adapters(args.model, Path(root), num_distinct=16, num_dirs=200)
        print(f"{args.sides} (lockstep):", file=sys.stderr)
        results = run_child(args, root)
    results["ratios"] = ratios(results)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


def _child(args) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    workload = _engine_bench().make_workload(args.requests, vocab)
    dirs = [str(Path(args.adapter_root) / f"lora-{i}") for i in range(200)]
    print(json.dumps(run_sides(args.side.split(","), args.model, workload, dirs, args.threads)))
    return {}


if __name__ == "__main__":
    main()
