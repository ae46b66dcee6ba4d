"""CPU LoRA microbenchmark: one decode step's LoRA updates over SmolLM2's 30 layers.

The weights of 30 layers x 4 projections (q/k/v packed, o, gate/up packed,
down) for 16 adapter slots of rank 16, random: 312 MB, far more than the
cache, so each call reads them from memory as a real decode step does.

  stream            sum() over the same tensors: what reading them costs at best
  shrink A @ x^T    the grid's shrink, A slot-major [G, S*R, H]
  expand, B [N, R]  y @ B^T with B stored as rows of R floats
  expand, B [R, N]  the same with B stored rank-major (the engine's layout)
  lora_linear ...   ``kernels.lora_linear`` as the engine calls it, per token mix

Each row is the median of interleaved repetitions (the machine is noisy);
GB/s is the bytes of weights the row needs (its adapters' share) over its time.

    python benchmarks/lora_cpu.py [--reps 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

SLOTS, RANK, LAYERS = 16, 16, 30
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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
