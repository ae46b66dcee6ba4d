"""Engine benchmark: lorapool's engine against transformers' generate, same workload.

Workload (fixed seed): 64 requests, prompt lengths 16-512, output lengths
16-256, greedy, every request arriving at once. lorapool runs it with
continuous batching; transformers runs it in batches of 16, left-padded, each
batch generating until its longest request is done (only the requested
tokens count). Each side runs in a subprocess of its own, so peak memory is
its own.

    python benchmarks/engine.py [--model DIR] [--requests 64] [--json out.json]

``--schema-every 4``: instead, what structured outputs cost the other requests of a
batch where every 4th request has a JSON schema (``_schemas.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path


def make_workload(num_requests: int, vocab_size: int, seed: int = 0):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(16, 512))],
            rng.randint(16, 256),
        )
        for _ in range(num_requests)
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_lorapool(model: str, workload, threads: int) -> dict:
    import torch

    from lorapool import EngineArgs, LLMEngine, SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, max_num_seqs=64, max_num_batched_tokens=2048)
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    return summary(*drive(engine, workload, params))


def drive(engine, workload, params, loras=None, label="", report=None):
    """Add every request at once, step until all finish: (output tokens, seconds, TTFTs).

    ``params`` and ``loras`` have one entry per request; ``report(done, total,
    start)`` shows progress (default: one line per finished request).
    """
    report = report or progress
    loras = loras or [None] * len(workload)
    start, wall_start = time.perf_counter(), time.time()
    for i, ((prompt, _), p, lora) in enumerate(zip(workload, params, loras)):
        engine.add_request(
            f"{label}{i}",
            {"prompt_token_ids": prompt},
            p,
            arrival_time=wall_start,
            lora_request=lora,
        )
    ttfts, tokens, done = [], 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done += 1
                tokens += len(out.outputs[0].token_ids)
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
                report(done, len(workload), start)
    return tokens, time.perf_counter() - start, ttfts


def pad_token_id(hf) -> int:
    """The pad id transformers' generate should use for ``hf``."""
    pad = hf.generation_config.pad_token_id or hf.config.eos_token_id
    return pad[0] if isinstance(pad, list) else pad


def padded_batch(batch, pad: int):
    """Left-padded input ids and attention mask of a batch, and its longest output."""
    import torch

    longest = max(len(p) for p, _ in batch)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in batch])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch])
    return ids, mask, max(n for _, n in batch)


def greedy_exactly(max_new: int, mask, pad: int, streamer) -> dict:
    """``generate`` options for greedy decoding of exactly ``max_new`` tokens, as the
    engine runs the workload (no early stop at EOS)."""
    return {
        "attention_mask": mask,
        "do_sample": False,
        "max_new_tokens": max_new,
        "min_new_tokens": max_new,
        "pad_token_id": pad,
        "streamer": streamer,
    }


def run_transformers(model: str, workload, threads: int, batch_size: int = 16) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = pad_token_id(hf)
    start = time.perf_counter()
    ttfts, tokens = [], 0
    for b in range(0, len(workload), batch_size):
        batch = workload[b : b + batch_size]
        ids, mask, max_new = padded_batch(batch, pad)
        clock = FirstTokenClock()
        with torch.inference_mode():
            hf.generate(ids, **greedy_exactly(max_new, mask, pad, clock))
        ttfts += [clock.first_token - start] * len(batch)
        tokens += sum(n for _, n in batch)
        progress(b + len(batch), len(workload), start)
    return summary(tokens, time.perf_counter() - start, ttfts)


class FirstTokenClock:
    """A generate() streamer that notes when the batch's first new tokens exist.

    generate() calls put() once with the prompt, then once per generated step.
    """

    def __init__(self):
        self.calls = 0
        self.first_token = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token = time.perf_counter()

    def end(self) -> None:
        pass


def summary(tokens: int, seconds: float, ttfts: list[float]) -> dict:
    return {
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(tokens / seconds, 1),
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p99_s": round(percentile(ttfts, 99), 3),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def progress(done: int, total: int, start: float) -> None:
    print(
        f"  {done}/{total} requests, {time.perf_counter() - start:.1f}s",
        file=sys.stderr,
        flush=True,
    )


def run_side(side: str, model: str, num_requests: int, threads: int) -> dict:
    """Run one side in a fresh interpreter; returns its summary."""
    cmd = [
        sys.executable,
        __file__,
        "--side",
        side,
        "--model",
        model,
        "--requests",
        str(num_requests),
        "--threads",
        str(threads),
    ]
    result = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--side", choices=["lorapool", "transformers"], default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--schema-every", type=int, default=None, help="see _schemas.py")
    parser.add_argument("--rounds", type=int, default=2, help="--schema-every: runs of each")
    args = parser.parse_args(argv)
    if args.model is None:
        from lorapool.settings import smollm2_dir

        args.model = str(smollm2_dir())
    if args.schema_every:
        return schemas_side(args)
    if args.side:
        from transformers import AutoConfig

        workload = make_workload(args.requests, AutoConfig.from_pretrained(args.model).vocab_size)
        runner = run_lorapool if args.side == "lorapool" else run_transformers
        print(json.dumps(runner(args.model, workload, args.threads)))
        return {}
    results = {}
    for side in ("lorapool", "transformers"):
        print(f"{side}:", file=sys.stderr)
        results[side] = run_side(side, args.model, args.requests, args.threads)
    results["ratio_output_tokens_per_s"] = round(
        results["lorapool"]["output_tokens_per_s"] / results["transformers"]["output_tokens_per_s"],
        2,
    )
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


def schemas_side(args) -> dict:
    from transformers import AutoConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _schemas import run_schemas

    workload = make_workload(args.requests, AutoConfig.from_pretrained(args.model).vocab_size)
    results = run_schemas(args.model, workload, args.threads, args.schema_every, args.rounds)
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
