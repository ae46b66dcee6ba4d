"""Section 4: throughput, each figure a ratio against a peer measured in the same run.

On the first model (the ~1B Llama), in the engine's default dtype (bf16 on CUDA):

- ours against transformers' ``generate``: ``batch`` requests of ``prompt_len``
  tokens, ``new_tokens`` each (no early stop), both warmed up first;
- 8 and 64 adapters (rank ``adapter_rank``, one per request in turn) against
  the base model, on one engine whose KV cache is sized from free memory
  (``gpu_memory_utilization``);
- the decode step (``batch`` sequences, every one decoding; the base model, then
  8 adapters) against its floor, the weights' bytes over the copy bandwidth of
  section 1, with CUDA graphs off and on (the same engine, captured per
  batch-size bucket). Eager greedy decoding must repeat itself token for token;
  with graphs the base model's tokens must not change, and with adapters they
  must be equal up to near ties (each run's token among the other's top 5 where
  they part): a graph runs the LoRA kernels over a fixed grid of tiles, which
  splits the shrink's reduction differently from an eager step.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from . import models, oracle
from .timing import Stopwatch


def run(ctx, rec) -> None:
    sizes, device = ctx.sizes, ctx.device
    shape = sizes.models[0]
    path, hf = models.build_model(shape, Path(ctx.workdir) / "models", device, load=False)
    oracle.free(hf)
    del hf
    prompts = [
        p[: sizes.prompt_len]
        for p in models.prompts(sizes.batch, 2 * sizes.prompt_len, shape.vocab_size, seed=1)
    ]
    adapters = models.adapters_for(
        path,
        shape,
        Path(ctx.workdir) / "tp-adapters",
        max(sizes.adapter_counts),
        (sizes.adapter_rank,),
        device,
    )
    hf_tps = _transformers(ctx, rec, path, prompts)
    engine = _engine(ctx, rec, path, len(adapters))
    ours = _timed_run(engine, prompts, sizes.new_tokens)
    rec.figure("ours_tokens_per_s", round(ours, 1))
    rec.figure("ours_over_transformers", round(ours / hf_tps, 3))
    _adapters(ctx, rec, engine, prompts, adapters, ours)
    _decode_floor(ctx, rec, engine, shape, adapters)


def _transformers(ctx, rec, path, prompts) -> float:
    dtype = _engine_dtype(ctx.device)
    hf = models.load_hf(path, ctx.device, dtype)
    ids = torch.tensor(prompts, device=ctx.device)
    n = ctx.sizes.new_tokens

    def generate(tokens):
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                pad_token_id=models.EOS,
            )

    generate(4)  # warm-up
    with Stopwatch(ctx.device) as clock:
        generate(n)
    tps = len(prompts) * n / clock.seconds
    rec.figure("transformers_tokens_per_s", round(tps, 1))
    rec.figure("dtype", str(dtype).removeprefix("torch."))
    hf = ids = None  # the closure above names them: rebind, then free
    oracle.free()
    return tps


def _engine_dtype(device: str) -> torch.dtype:
    from lorapool.engine.config import EngineArgs

    return EngineArgs(model="-").resolve_dtype(torch.device(device), torch.float32)


def _engine(ctx, rec, path, max_loras: int):
    sizes = ctx.sizes
    options = dict(
        max_num_seqs=sizes.batch,
        max_num_batched_tokens=max(2048, sizes.batch * 2),
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=max_loras,
        max_lora_rank=sizes.adapter_rank,
        enforce_eager=ctx.device != "cuda",
        cuda_graph_sizes=list(sizes.graph_sizes),
    )
    if ctx.device == "cuda":
        options |= {"kv_cache_memory": None, "gpu_memory_utilization": sizes.gpu_memory_utilization}
    t0 = time.time()
    try:
        engine = oracle.make_engine(path, ctx.device, "auto", **options)
    except Exception as exc:  # graphs that fail to capture must not cost the section
        if options["enforce_eager"]:
            raise
        rec.check("CUDA graphs capture", False, repr(exc)[:800])
        oracle.free()
        engine = oracle.make_engine(path, ctx.device, "auto", **options | {"enforce_eager": True})
    runner = engine.runner
    rec.figure("engine_start_s", round(time.time() - t0, 1))
    rec.figure("engine_dtype", str(runner.dtype).removeprefix("torch."))
    rec.figure("kv_blocks", runner.num_blocks)
    rec.figure("kv_cache_GiB", round(runner.num_blocks * runner._block_bytes() / 2**30, 2))
    if ctx.device == "cuda":
        rec.figure("gpu_memory_utilization", sizes.gpu_memory_utilization)
        free, total = torch.cuda.mem_get_info()
        rec.figure("used_after_kv_share", round(1 - free / total, 3))
    graphs = getattr(runner, "graphs", None)
    rec.figure("cuda_graph_sizes", graphs.sizes if graphs else "off (eager)")
    return engine


def _timed_run(engine, prompts, new_tokens: int, loras=None) -> float:
    """Output tokens a second of one continuous batch (a short warm-up run first)."""
    from lorapool import SamplingParams

    def drive(tokens, tag):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            lora = loras[i] if loras else None
            engine.add_request(f"{tag}{i}", {"prompt_token_ids": prompt}, params, lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()

    drive(2, "warm")
    t0 = time.perf_counter()
    drive(new_tokens, "run")
    return len(prompts) * new_tokens / (time.perf_counter() - t0)


def _adapters(ctx, rec, engine, prompts, adapters: dict, base_tps: float) -> None:
    for count in ctx.sizes.adapter_counts:
        if ctx.time_left() < 0:
            rec.cut_short(f"the {count}-adapter run")
            return
        loras = _loras(adapters, count, len(prompts))
        tps = _timed_run(engine, prompts, ctx.sizes.new_tokens, loras)
        rec.figure(f"adapters_{count}_tokens_per_s", round(tps, 1))
        rec.figure(f"adapters_{count}_over_base", round(tps / base_tps, 3))


def _decode_floor(ctx, rec, engine, shape, adapters: dict) -> None:
    runner = engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    rec.figure("weights_GB", round(weight_bytes / 1e9, 3))
    floor_s = weight_bytes / (ctx.copy_gbps * 1e9) if ctx.copy_gbps else None
    if floor_s:
        rec.figure("decode_floor_ms", round(floor_s * 1e3, 3))
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        rec.note("CUDA graphs: not on this device (eager only)")
    count = min(ctx.sizes.adapter_counts)
    loras = _loras(adapters, count, ctx.sizes.batch)
    for label, requests_loras in (("base", None), (f"lora{count}", loras)):
        tokens = {}
        for mode in ("eager", "graphs") if graphs is not None else ("eager",):
            if ctx.time_left() < 0:
                rec.cut_short(f"the {label} {mode} decode timing")
                return
            if graphs is not None:
                graphs.enabled, graphs.replays = mode == "graphs", 0
            step_s, tokens[mode] = _decode_steps(engine, ctx.sizes, shape, requests_loras)
            rec.figure(f"decode_step_ms_{label}_{mode}", round(step_s * 1e3, 3))
            if floor_s:
                rec.figure(f"decode_step_over_floor_{label}_{mode}", round(step_s / floor_s, 2))
            if graphs is not None:
                rec.figure(f"graph_replays_{label}_{mode}", graphs.replays)
        if "graphs" in tokens:
            replayed = graphs.replays
            rec.check(f"{label}: CUDA graphs replayed", replayed > 0, str(replayed))
            _graph_parity(ctx, rec, engine, graphs, shape, label, requests_loras)


TOP_K = 5


def _graph_parity(ctx, rec, engine, graphs, shape, label, loras) -> None:
    """Greedy tokens with graphs against eager; eager against itself gives the noise floor."""
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


def _loras(adapters: dict, count: int, num: int) -> list:
    from lorapool import LoRARequest

    names = list(adapters)
    return [
        LoRARequest(names[i % count], i % count + 1, str(adapters[names[i % count]]))
        for i in range(num)
    ]


def _decode_steps(engine, sizes, shape, loras=None) -> tuple[float, list]:
    """Median seconds of steps in which all ``batch`` sequences decode; the tokens made."""
    from lorapool import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=sizes.decode_tokens, ignore_eos=True)
    prompts = models.prompts(sizes.batch, 16, shape.vocab_size, seed=2)
    for i, prompt in enumerate(prompts):
        lora = loras[i] if loras else None
        engine.add_request(f"dec{i}", {"prompt_token_ids": prompt}, params, lora_request=lora)
    times, done = [], {}
    while engine.has_unfinished_requests():
        decoding = _all_decoding(engine, sizes.batch)
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if decoding:
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:] or times), [done[k] for k in sorted(done)]


def _all_decoding(engine, batch: int) -> bool:
    running = engine.scheduler.running
    return (
        not engine.scheduler.waiting
        and len(running) == batch
        and all(s.num_computed_tokens >= s.num_prompt_tokens for s in running)
    )
