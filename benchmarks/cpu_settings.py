"""CPU engine settings, each on and off, on one decode step of the engine benchmark's workload.

The workload's 64 requests (SmolLM2, prompts of 16-512 tokens) are prefilled
in one engine; then every step decodes one token for all 64, and the two sides
alternate step by step (the machine's drift falls on both) for ``--steps``
steps each, after 3 steps to warm up:

  skinny    ``PackedLinear``'s (W @ x^T)^T form for decode-sized products
            against plain x @ W^T (``SKINNY_TOKENS`` = 0)
  grouping  decode attention gathered in groups of similar context length
            against one group padded to the longest (``GROUP_MIN_SHARE`` = 0)

``--adapters 16`` gives request i adapter i % 16 (rank 16, all seven projections),
as the lora benchmark's lora16 side does. Means are what throughput sees;
medians, what a typical step costs.

    python benchmarks/cpu_settings.py skinny|grouping [--adapters 16] [--steps 20]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

SIDES = {"skinny": ("skinny", "plain"), "grouping": ("grouped", "one_group")}


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decoding_engine(model: str, num_adapters: int, num_steps: int, adapter_root: str):
    """An engine whose 64 requests are all past prefill, each outliving the steps to come."""
    import torch
    from transformers import AutoConfig

    from lorapool import EngineArgs, LLMEngine, LoRARequest, SamplingParams

    torch.set_num_threads(2)
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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("compare", choices=sorted(SIDES))
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--adapters", type=int, default=0, help="distinct adapters (0: none)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps a side")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    main()
