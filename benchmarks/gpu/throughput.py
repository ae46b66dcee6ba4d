"""Section 4: throughput, each figure a ratio against a peer measured in the same run.

On the first model (the ~1B Llama), in the engine's default dtype (bf16 on CUDA):

- ours against transformers' ``generate``: ``batch`` requests of ``prompt_len``
  tokens, ``new_tokens`` each (no early stop), both warmed up first; and
  against ``BASELINE_TOKENS_PER_S`` (today's figure on the H200);
- 8 and 64 adapters (rank ``adapter_rank``, one per request in turn) against
  the base model, on one engine whose KV cache is sized from free memory
  (``gpu_memory_utilization``);
- the decode step (``decode_step``) at each of ``decode_batches`` (64 and
  256), the base model, 8 adapters and (at the first batch) 64, with CUDA
  graphs and eagerly, against its bytes floor and its practical floor
  (``floors``), split into host phases and GPU time; then the base model's step
  sampled at temperature 1, with and without top-p (graphs where there), against the
  greedy one;
- greedy tokens with graphs against eager (``graph_parity``);
- each engine speed flag (``flags``) on against the old path, the same decode
  steps with graphs, one engine per flag: "flag absent" where EngineArgs lacks it.

Every measurement is wrapped: one that raises records a failed check and the
section goes on.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from . import decode_step, flags, graph_parity, models, oracle
from .timing import CompileGuard, Stopwatch

BASELINE_TOKENS_PER_S = 10_110  # ours at batch 64 on the H200 before issue 47 (RESULTS.md)


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
    _measured(rec, "host copy check", decode_step.host_copy_check, ctx, rec)
    hf_tps = _transformers(ctx, rec, path, prompts)
    guard = CompileGuard()
    engine = make_engine(ctx, rec, path, len(adapters), flags.old_path(sizes.engine_flags))
    ours = _timed_run(engine, prompts, sizes.new_tokens, guard=guard)
    rec.figure("ours_tokens_per_s", round(ours, 1))
    rec.figure("ours_over_transformers", round(ours / hf_tps, 3))
    rec.figure("acceptance_tokens_per_s_over_10110", round(ours / BASELINE_TOKENS_PER_S, 3))
    _adapters(ctx, rec, engine, prompts, adapters, ours, guard)
    old = _decode(ctx, rec, engine, shape, adapters, guard)
    _parity(ctx, rec, engine, shape, adapters)
    del engine
    oracle.free()
    _flags(ctx, rec, path, shape, adapters, old, guard)
    guard.report(rec, "throughput")


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


def make_engine(ctx, rec, path, max_loras: int, extra: dict | None = None, tag: str = ""):
    """An engine for ``batch`` and every decode batch, graphs captured on CUDA (eager if the
    capture fails: a failed check); ``extra``: more EngineArgs (the flags)."""
    sizes = ctx.sizes
    seqs = max(sizes.batch, *sizes.decode_batches)
    options = dict(
        max_num_seqs=seqs,
        max_num_batched_tokens=max(2048, seqs * 2),
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=max_loras,
        max_lora_rank=sizes.adapter_rank,
        enforce_eager=ctx.device != "cuda",
        cuda_graph_sizes=sorted({*sizes.graph_sizes, *sizes.decode_batches}),
    ) | (extra or {})
    if ctx.device == "cuda":
        options |= {"kv_cache_memory": None, "gpu_memory_utilization": sizes.gpu_memory_utilization}
    t0 = time.time()
    try:
        engine = oracle.make_engine(path, ctx.device, "auto", **options)
    except Exception as exc:  # graphs that fail to capture must not cost the section
        if options["enforce_eager"]:
            raise
        rec.check(f"{tag}CUDA graphs capture", False, repr(exc)[:800])
        oracle.free()
        engine = oracle.make_engine(path, ctx.device, "auto", **options | {"enforce_eager": True})
    runner = engine.runner
    rec.figure(f"{tag}engine_start_s", round(time.time() - t0, 1))
    if tag:
        return engine
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


def _timed_run(engine, prompts, new_tokens: int, loras=None, guard=None) -> float:
    """Output tokens a second of one continuous batch, after a warm-up on the identical
    workload; the timed run inside ``guard``'s window."""
    from lorapool import SamplingParams

    def drive(tokens, tag):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            lora = loras[i] if loras else None
            engine.add_request(f"{tag}{i}", {"prompt_token_ids": prompt}, params, lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()

    drive(new_tokens, "warm")
    label = f"throughput run, {len({r.lora_int_id for r in loras or ()})} adapters"
    with guard.window(label) if guard else contextlib.nullcontext():
        t0 = time.perf_counter()
        drive(new_tokens, "run")
        seconds = time.perf_counter() - t0
    return len(prompts) * new_tokens / seconds


def _adapters(ctx, rec, engine, prompts, adapters: dict, base_tps: float, guard) -> None:
    for count in ctx.sizes.adapter_counts:
        if ctx.time_left() < 0:
            rec.cut_short(f"the {count}-adapter run")
            return
        loras = loras_of(adapters, count, len(prompts))
        tps = _timed_run(engine, prompts, ctx.sizes.new_tokens, loras, guard)
        rec.figure(f"adapters_{count}_tokens_per_s", round(tps, 1))
        rec.figure(f"adapters_{count}_over_base", round(tps / base_tps, 3))


def configurations(ctx, adapters: dict, modes, labels=None):
    """(where, loras) of every decode configuration: batch x adapters x mode; the most
    adapters at the first batch only (and only among ``labels`` when given)."""
    sizes = ctx.sizes
    few, most = min(sizes.adapter_counts), max(sizes.adapter_counts)
    for i, batch in enumerate(sizes.decode_batches):
        counts = [0, few] + ([most] if i == 0 and most != few else [])
        for count in counts:
            label = f"lora{count}" if count else "base"
            if labels is not None and label not in labels:
                continue
            names = list(adapters)[:count]
            loras = loras_of(adapters, count, batch) if count else None
            for mode in modes:
                where = {"label": label, "batch": batch, "mode": mode}
                yield where | {"adapters": [adapters[n] for n in names]}, loras


def _decode(ctx, rec, engine, shape, adapters, guard) -> dict:
    """The old path's decode steps: {(label, batch, mode): StepRun}."""
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is None:
        rec.note("CUDA graphs: not on this device (eager only)")
    modes = ("graphs", "eager") if graphs is not None else ("eager",)
    practical = decode_step.practical_floors(ctx, rec, engine, guard)
    runs = {}
    for where, loras in configurations(ctx, adapters, modes):
        key = (where["label"], where["batch"], where["mode"])
        if ctx.time_left() < 0:
            rec.cut_short(f"the decode step {key} and what follows")
            break
        if graphs is not None:
            graphs.enabled, graphs.replays = where["mode"] == "graphs", 0
        run = _measured(
            rec,
            f"decode step {key}",
            decode_step.decode_run,
            engine,
            ctx,
            shape,
            where["batch"],
            loras,
            guard,
            f"decode {key}",
        )
        if run is None:
            continue
        runs[key] = run
        decode_step.record(ctx, rec, engine, shape, run, where, practical)
        if graphs is not None and where["mode"] == "graphs":
            rec.check(f"{key}: CUDA graphs replayed", graphs.replays > 0, str(graphs.replays))
    if graphs is not None:
        graphs.enabled = True
    _ratios(ctx, rec, runs)
    _sampled(ctx, rec, engine, shape, runs, practical, guard)
    return runs


# the sampled decode steps (seeded, temperature 1), by label: top_p. "sampled": the
# OpenAI API's defaults; "nucleus": top_p 0.95, whose synchronous search reads back
# which rows it settled (async scheduling sorts each row whole instead)
SAMPLINGS = {"sampled": 1.0, "nucleus": 0.95}


def _sampled(ctx, rec, engine, shape, greedy: dict, practical: dict, guard) -> None:
    """The base model's decode step at temperature 1 (seeded), with and without top-p
    (``SAMPLINGS``), graphs where there: the sampler's path, which OpenAI clients take
    by default, against the greedy step. Each run joins ``greedy`` under (label, batch,
    mode), for the flags to compare with."""
    graphs = getattr(engine.runner, "graphs", None)
    mode = "graphs" if graphs is not None else "eager"
    for label, top_p in SAMPLINGS.items():
        for batch in ctx.sizes.decode_batches:
            key = (label, batch, mode)
            if ctx.time_left() < 0:
                rec.cut_short(f"the {label} decode step {key} and what follows")
                return
            if graphs is not None:
                graphs.replays = 0
            args = (engine, ctx, shape, batch, None, guard, f"decode {key}", 1.0, top_p)
            run = _measured(rec, f"decode step {key}", decode_step.decode_run, *args)
            if run is None:
                continue
            where = {"label": label, "batch": batch, "mode": mode}
            decode_step.record(ctx, rec, engine, shape, run, where, practical)
            greedy[key] = run
            if ("base", batch, mode) in greedy:
                ratio = run.step_s / greedy["base", batch, mode].step_s
                rec.figure(f"step_{label}_over_greedy_b{batch}_{mode}", round(ratio, 3))
            if graphs is not None:
                replays = str(graphs.replays)
                rec.check(f"{key}: CUDA graphs replayed", graphs.replays > 0, replays)


def _measured(rec, what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # one measurement's failure must not cost the section
        rec.check(f"{what} ran", False, repr(exc)[:800])
        oracle.free()
        return None


def _ratios(ctx, rec, runs: dict) -> None:
    for (label, batch, mode), run in runs.items():
        base = runs.get(("base", batch, mode))
        if label != "base" and base:
            ratio = round(run.step_s / base.step_s, 3)
            rec.figure(f"step_{label}_over_base_b{batch}_{mode}", ratio)
    first, mode = ctx.sizes.decode_batches[0], next(iter(runs), (0, 0, "eager"))[2]
    figures = rec.data["figures"]
    for key, name in (
        (f"step_over_practical_floor_base_b{first}_{mode}", "step_over_practical_floor"),
        (f"step_over_bytes_floor_base_b{first}_{mode}", "step_over_bytes_floor"),
    ):
        if key in figures:
            rec.figure(f"acceptance_{mode}_{name}", figures[key])
    for count in ctx.sizes.adapter_counts:
        key = f"step_lora{count}_over_base_b{first}_{mode}"
        if key in figures:
            rec.figure(f"acceptance_step_lora{count}_over_base", figures[key])


def _parity(ctx, rec, engine, shape, adapters) -> None:
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is None:
        return
    count = min(ctx.sizes.adapter_counts)
    for label, loras in (
        ("base", None),
        (f"lora{count}", loras_of(adapters, count, ctx.sizes.batch)),
    ):
        _measured(
            rec,
            f"{label} graph parity",
            graph_parity.check,
            ctx,
            rec,
            engine,
            graphs,
            shape,
            label,
            loras,
        )


SAMPLED_FLAGS = ("async_scheduling",)  # flags whose sampled steps are measured too


def _flags(ctx, rec, path, shape, adapters, old: dict, guard) -> None:
    """Each present flag on, alone, against the old path's decode steps (graphs where
    there); those of ``SAMPLED_FLAGS`` at temperature 1 (seeded, ``SAMPLINGS``) too."""
    names = ctx.sizes.engine_flags
    mode = next(iter(old), (0, 0, "eager"))[2]
    for name, there in flags.present(names).items():
        rec.figure(f"flag_{name}", "present" if there else "flag absent")
        if not there:
            continue
        if ctx.time_left() < 0:
            rec.cut_short(f"the {name} runs")
            return
        tag = f"{name}_on_"
        options = flags.old_path(names) | {name: True}
        engine = _measured(
            rec, f"an engine with {name}", make_engine, ctx, rec, path, len(adapters), options, tag
        )
        if engine is None:
            continue
        wanted = ("base", f"lora{min(ctx.sizes.adapter_counts)}")
        runs = [
            (where, loras, (0.0, 1.0))
            for where, loras in configurations(ctx, adapters, (mode,), wanted)
        ]
        if name in SAMPLED_FLAGS:
            for label, top_p in SAMPLINGS.items():
                sampled = {"label": label, "mode": mode, "adapters": []}
                runs += [
                    (sampled | {"batch": b}, None, (1.0, top_p)) for b in ctx.sizes.decode_batches
                ]
        for where, loras, sampling in runs:
            key = (where["label"], where["batch"], mode)
            if ctx.time_left() < 0:
                rec.cut_short(f"the {name} decode step {key}")
                break
            args = (engine, ctx, shape, where["batch"], loras, guard, f"{name} {key}", *sampling)
            run = _measured(rec, f"{name} decode step {key}", decode_step.decode_run, *args)
            if run is None:
                continue
            decode_step.record(ctx, rec, engine, shape, run, where | {"tag": tag}, {})
            suffix = f"{key[0]}_b{key[1]}"
            if key in old:
                rec.figure(
                    f"flag_{name}_on_over_off_{suffix}", round(run.step_s / old[key].step_s, 3)
                )
                same = oracle.agreement(run.tokens, old[key].tokens)
                rec.figure(f"flag_{name}_tokens_vs_off_{suffix}", f"{same.exact}/{same.total}")
        del engine
        oracle.free()


def loras_of(adapters: dict, count: int, num: int) -> list:
    from lorapool import LoRARequest

    names = list(adapters)
    return [
        LoRARequest(names[i % count], i % count + 1, str(adapters[names[i % count]]))
        for i in range(num)
    ]
