"""CPU linear microbenchmark: SmolLM2's 30 layers of projections, two forms of x @ W^T.

  plain    ``F.linear(x, W)``: x @ W^T, row-major result
  skinny   ``torch.mm(W, x.T).T``: (W @ x^T)^T, a column-major view of the result
           (what ``PackedLinear`` does for at most ``SKINNY_TOKENS`` tokens)

for M tokens; the weights (425 MB) are far larger than the cache, so each
repetition streams them from memory as a decode step does. Each figure is the
median of interleaved repetitions; GFLOP/s is 2 * M * weights over that time.

    python benchmarks/linear_cpu.py [--tokens 4,16,64,128,256,512,1024] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# (out_features, in_features) of SmolLM2's projections: qkv, o, gate_up, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4,16,64,128,256,512,1024")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
