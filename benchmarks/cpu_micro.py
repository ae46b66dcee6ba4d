"""CPU micro-benchmarks: what the CPU decode step is made of, and the settings that shaped it.

Three kinds, each alternating or interleaving its sides in one process so that the
machine's drift falls on both; results are kept in RESULTS.md ("CPU engine").

  step skinny|grouping  one decode step of the engine benchmark's workload (SmolLM2, 64
            requests, prompts of 16-512 tokens, all past prefill), a setting on and off:
              skinny    ``PackedLinear``'s (W @ x^T)^T form for decode-sized products
                        against plain x @ W^T (``SKINNY_TOKENS`` = 0)
              grouping  decode attention gathered in groups of similar context length
                        against one group padded to the longest (``GROUP_MIN_SHARE`` = 0)
            ``--adapters 16`` gives request i adapter i % 16 (rank 16, all seven
            projections), as the lora benchmark's lora16 side does. Means are what
            throughput sees; medians, what a typical step costs.
  linear    SmolLM2's 30 layers of projections (425 MB of weights, streamed from memory
            as a decode step does), ``F.linear(x, W)`` against ``torch.mm(W, x.T).T``
            for M tokens; medians of interleaved repetitions, GFLOP/s = 2 * M * weights / time.
  lora      one decode step's LoRA updates over 30 layers x 4 projections for 16 adapter
            slots of rank 16 (312 MB, random): streaming the bytes, the shrink and expand
            matmuls alone, and ``kernels.lora_linear`` as the engine calls it per token mix;
            GB/s is the bytes of weights the row needs over its median time.

    python benchmarks/cpu_micro.py step skinny|grouping [--adapters 16] [--steps 20]
    python benchmarks/cpu_micro.py linear [--tokens 4,16,64,128,256,512,1024] [--reps 5]
    python benchmarks/cpu_micro.py lora [--reps 15]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

LAYERS = 30  # SmolLM2's decoder layers


# --- step: one engine decode step, a setting on and off ------------------------------

SIDES = {"skinny": ("skinny", "plain"), "grouping": ("grouped", "one_group")}


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decoding_engine(model: str, num_adapters: int, num_steps: int, adapter_root: str):
    """An engine whose 64 requests are all past prefill, each outliving the steps to come."""
    from transformers import AutoConfig

    from lorapool import EngineArgs, LLMEngine, LoRARequest, SamplingParams

    lora_args, loras = {}, [None] * 64
    if num_adapters:
        lora = _bench_module("lora")
        dirs = lora.write_adapters(model, Path(adapter_root), num_adapters, num_adapters)
        lora_args = dict(enable_lora=True, max_loras=num_adapters, max_lora_rank=lora.RANK)
        loras = [
            LoRARequest(f"lora-{i % num_adapters}", i % num_adapters + 1, dirs[i % num_adapters])
            for i in range(64)
        ]
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, max_num_seqs=64, max_num_batched_tokens=2048, **lora_args)
    )
    vocab = AutoConfig.from_pretrained(model).vocab_size
    workload = _bench_module("engine").make_workload(64, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=2 * num_steps + 16, ignore_eos=True)
    for i, ((prompt, _), lora_request) in enumerate(zip(workload, loras)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params, lora_request=lora_request)
    started: set[str] = set()
    while len(started) < len(workload):
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    for _ in range(3):
        engine.step()
    return engine


def alternate(compare: str, engine, num_steps: int) -> dict:
    """Steps of the two sides of ``compare`` in turn: their mean and median in ms."""
    from lorapool.engine.models import layers
    from lorapool.kernels import attention_plan

    sides = SIDES[compare]
    times = {side: [] for side in sides}
    skinny, share = layers.SKINNY_TOKENS, attention_plan.GROUP_MIN_SHARE
    try:
        for i in range(2 * num_steps):
            side = sides[i % 2]
            layers.SKINNY_TOKENS = 0 if side == "plain" else skinny
            attention_plan.GROUP_MIN_SHARE = 0.0 if side == "one_group" else share
            start = time.perf_counter()
            outputs = engine.step()
            times[side].append(time.perf_counter() - start)
            assert len(outputs) == 64, "a step decoded fewer than all 64 sequences"
    finally:
        layers.SKINNY_TOKENS, attention_plan.GROUP_MIN_SHARE = skinny, share
    return {
        side: {
            "mean_ms": round(statistics.mean(t) * 1e3, 1),
            "median_ms": round(statistics.median(t) * 1e3, 1),
        }
        for side, t in times.items()
    }


def run_step(args) -> dict:
    if args.model is None:
        from lorapool.settings import smollm2_dir

        args.model = str(smollm2_dir())
    with tempfile.TemporaryDirectory(prefix="lorapool-bench-cpu-") as root:
        engine = decoding_engine(args.model, args.adapters, args.steps, root)
        sides = alternate(args.compare, engine, args.steps)
    first, second = SIDES[args.compare]
    results = {"compare": args.compare, "adapters": args.adapters, **sides}
    results[f"{first}_vs_{second}"] = round(sides[first]["mean_ms"] / sides[second]["mean_ms"], 3)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


# --- linear: the two forms of x @ W^T -----------------------------------------------

# (out_features, in_features) of SmolLM2's projections: qkv, o, gate_up, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def run_linear(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for _ in range(LAYERS) for n, k in SHAPES]
    forms = {
        "plain": lambda x, w: F.linear(x, w),
        "skinny": lambda x, w: torch.mm(w, x.t()).t(),
    }
    results = {}
    print(f"{'tokens':>6} {'plain ms':>9} {'skinny ms':>9} {'GFLOP/s':>15} {'skinny/plain':>12}")
    for m in (int(t) for t in args.tokens.split(",")):
        inputs = {k: torch.randn(m, k, generator=gen) for _, k in SHAPES}
        times = {name: [] for name in forms}
        for _ in range(args.reps):
            for name, form in forms.items():
                start = time.perf_counter()
                for w in weights:
                    form(inputs[w.shape[1]], w)
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) for name, t in times.items()}
        flops = 2 * m * sum(w.numel() for w in weights)
        results[m] = {name: round(t * 1e3, 1) for name, t in med.items()}
        print(
            f"{m:>6} {med['plain'] * 1e3:>9.1f} {med['skinny'] * 1e3:>9.1f} "
            f"{flops / med['plain'] / 1e9:>7.0f}/{flops / med['skinny'] / 1e9:<7.0f} "
            f"{med['skinny'] / med['plain']:>12.2f}",
            flush=True,
        )
    return results


# --- lora: one decode step's LoRA updates, by part ------------------------------------

SLOTS, RANK = 16, 16
# (H_in, slice widths) of SmolLM2's projections: qkv, o, gate_up, down
PROJECTIONS = [(576, [576, 192, 192]), (576, [576]), (576, [1536, 1536]), (1536, [576])]


def make_layers(gen: torch.Generator):
    """Per projection: A [S, L, R, H] (slot-major storage), B as [L, N, R] views
    of rank-major and of plain storage."""
    layers = []
    for _ in range(LAYERS):
        for hidden, widths in PROJECTIONS:
            a = torch.randn(SLOTS, len(widths), RANK, hidden, generator=gen) * 0.02
            b_t = torch.randn(SLOTS, RANK, sum(widths), generator=gen) * 0.02
            layers.append(
                (a.transpose(0, 1), b_t.transpose(1, 2), b_t.transpose(1, 2).contiguous())
            )
    return layers


def token_mix(num_tokens: int, num_adapters: int, seed: int = 0) -> list[int]:
    """Slots of a decode batch: ``num_tokens`` tokens over ``num_adapters`` random slots."""
    rng = random.Random(seed)
    used = rng.sample(range(SLOTS), num_adapters)
    return [used[i % num_adapters] for i in range(num_tokens)]


def cases(layers, gen):
    """name -> (bytes read, function)."""
    from lorapool import kernels
    from lorapool.kernels import LoRAMapping

    a_bytes = sum(a.numel() for a, _, _ in layers) * 4
    b_bytes = sum(b.numel() for _, b, _ in layers) * 4
    xs = {h: torch.randn(SLOTS, 4, h, generator=gen) for h, _ in PROJECTIONS}
    y = torch.randn(SLOTS, 4, RANK, generator=gen)

    def shrink():
        for a, _, _ in layers:
            merged = a.transpose(0, 1).reshape(SLOTS, -1, a.shape[-1])
            torch.bmm(merged, xs[a.shape[-1]].transpose(1, 2))

    def expand(plain: bool):
        for _, b, b_plain in layers:
            torch.bmm(y, (b_plain if plain else b).transpose(1, 2))

    def stream():
        for a, b, _ in layers:
            a.sum(), b.sum()

    def full(slots, plain=False):
        mapping = LoRAMapping.from_slots(slots)
        x = {h: torch.randn(len(slots), h, generator=gen) for h, _ in PROJECTIONS}
        out = {n: torch.zeros(len(slots), n) for n in {sum(w) for _, w in PROJECTIONS}}

        def run():
            for (a, b, b_plain), (hidden, widths) in zip(layers, PROJECTIONS * LAYERS):
                w = b_plain if plain else b
                kernels.lora_linear(x[hidden], a, w, mapping, out[w.shape[1]], widths)

        return run

    return {
        "stream": (a_bytes + b_bytes, stream),
        "shrink A @ x^T": (a_bytes, shrink),
        "expand, B [N, R]": (b_bytes, lambda: expand(True)),
        "expand, B [R, N]": (b_bytes, lambda: expand(False)),
        "lora_linear 64 tok / 16 adapters": (a_bytes + b_bytes, full(token_mix(64, 16))),
        "lora_linear 64 tok / 16, B [N, R]": (a_bytes + b_bytes, full(token_mix(64, 16), True)),
        "lora_linear 12 tok / 8 adapters": ((a_bytes + b_bytes) // 2, full(token_mix(12, 8))),
        "lora_linear 4 tok / 4 adapters": ((a_bytes + b_bytes) // 4, full(token_mix(4, 4))),
    }


def run_lora(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    table = cases(make_layers(gen), gen)
    times = {name: [] for name in table}
    for rep in range(args.reps):
        for name, (_, fn) in table.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        print(f"  repetition {rep + 1}/{args.reps}", flush=True)
    results = {}
    print(f"{'case':36s} {'ms':>7s} {'GB/s':>6s}")
    for name, (nbytes, _) in table.items():
        median = sorted(times[name])[len(times[name]) // 2]
        results[name] = {"ms": round(median * 1e3, 1), "GB/s": round(nbytes / 2**30 / median, 1)}
        print(f"{name:36s} {median * 1e3:7.1f} {nbytes / 2**30 / median:6.1f}")
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    kinds = parser.add_subparsers(dest="kind", required=True)
    step = kinds.add_parser("step", help="one engine decode step, a setting on and off")
    step.add_argument("compare", choices=sorted(SIDES))
    step.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    step.add_argument("--adapters", type=int, default=0, help="distinct adapters (0: none)")
    step.add_argument("--steps", type=int, default=20, help="timed steps a side")
    step.add_argument("--json", default=None, help="also write the results here")
    linear = kinds.add_parser("linear", help="x @ W^T against (W @ x^T)^T by tokens")
    linear.add_argument("--tokens", default="4,16,64,128,256,512,1024")
    linear.add_argument("--reps", type=int, default=5)
    lora = kinds.add_parser("lora", help="one decode step's LoRA updates, by part")
    lora.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return {"step": run_step, "linear": run_linear, "lora": run_lora}[args.kind](args)


if __name__ == "__main__":
    main()
