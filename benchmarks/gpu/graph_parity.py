"""Greedy tokens with CUDA graphs against eager; eager against itself gives the noise floor.

Eager greedy decoding must repeat itself token for token; with graphs the base
model's tokens must not change, and with adapters they must be equal up to near
ties (each run's token among the other's top 5 where they part): a graph runs
the LoRA kernels over a fixed grid of tiles, which splits the shrink's
reduction differently from an eager step.
"""

from __future__ import annotations

from . import models, oracle

TOP_K = 5


def check(ctx, rec, engine, graphs, shape, label, loras) -> None:
    if ctx.time_left() < 0:
        rec.cut_short(f"the {label} graph parity runs")
        return
    prompts = models.prompts(ctx.sizes.batch, 16, shape.vocab_size, seed=2)
    n = ctx.sizes.decode_tokens
    runs = {}
    for mode in ("eager", "eager_again", "graphs"):
        graphs.enabled, graphs.replays = mode == "graphs", 0
        runs[mode] = oracle.engine_greedy_top(engine, prompts, n, loras, k=TOP_K, ignore_eos=True)
    rec.figure(f"{label}_parity_graph_replays", graphs.replays)
    graphs.enabled = True
    (eager, eager_tops), (again, _), (graphed, graph_tops) = runs.values()
    repeat = oracle.agreement(again, eager)
    same = oracle.agreement(graphed, eager)
    rec.figure(f"{label}_eager_repeat_exact", f"{repeat.exact}/{repeat.total}")
    rec.figure(f"{label}_graphs_vs_eager_exact", f"{same.exact}/{same.total}")
    rec.figure(f"{label}_graphs_vs_eager_agreement", same.share)
    rec.check(
        f"{label}: eager greedy decoding repeats itself token for token",
        repeat.exact == repeat.total,
        f"first differences (request, token): {repeat.first_diffs}",
    )
    if loras is None:  # the same kernels on the same shapes, captured or not: the same bits
        rec.check(
            f"{label}: greedy tokens equal with and without CUDA graphs",
            same.exact == same.total,
            f"first differences (request, token): {same.first_diffs}",
        )
        return
    # A graph runs the LoRA kernels over a fixed grid (cuda_graphs.max_tiles tiles of
    # LORA_BLOCK_M rows), so the shrink's reduction is split differently from an eager
    # step's: other sums in another order. Equal up to near ties is what can be asked.
    real = oracle.not_near_ties(graphed, eager, graph_tops, lambda i, pos: eager_tops[i][pos])
    rec.check(
        f"{label}: greedy tokens with CUDA graphs equal eager's up to near ties "
        f"(each token in the other's top {TOP_K} where they part)",
        not real,
        "; ".join(real[:10]),
    )
