"""The decode step: timed per batch, adapters and mode, against its two floors.

A decode step here is a step in which all ``batch`` sequences decode (prompts of
8-16 tokens, ``decode_tokens`` new tokens each, no early stop), greedy or, with
``temperature`` > 0, through the sampler (seeded: the tokens repeat run to run). Each
configuration first runs the identical workload untimed (every shape the timed
run meets, compiled), then again timed, inside a ``CompileGuard`` window: a
Triton compile during the timed run fails the section's compile check. Each
kept step is split into host phases and GPU time (``timeline.StepTimeline``).

Figures, per batch B, label (base, loraN; sampled: the base model at temperature 1)
and mode (graphs, eager): ``decode_step_ms_<label>_b<B>_<mode>`` (median kept step),
``step_over_bytes_floor_...`` and ``step_over_practical_floor_...``
(``floors``), ``step_<label>_over_base_b<B>_<mode>`` and
``step_sampled_over_greedy_b<B>_<mode>``; and one row of the
``step_timeline`` table (mean phases; they add up to the mean step, whose
``implied_tokens_per_s`` = B / mean step).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from . import floors, models
from .timeline import StepTimeline

# The sampled runs' requests' seed: their draws repeat run to run. A seeded row costs
# the sampler a per-row hash on the host (+0.3 ms a step at batch 256 over unseeded rows,
# 2-core box, 98cded3; +1.1 ms before it); None times the unseeded draw instead.
SAMPLED_SEED = 1234
# Device work queued before each copy of ``host_copy_check`` (milliseconds).
QUEUED_MS = 20


@dataclass
class StepRun:
    step_s: float  # median kept step
    mean_step_s: float
    tokens: list[list[int]]  # each request's new tokens, in request order
    context_tokens: float  # the kept steps' contexts summed over sequences, mean
    timeline: dict


def decode_run(
    engine, ctx, shape, batch: int, loras=None, guard=None, label="", temperature=0.0, top_p=1.0
) -> StepRun:
    """The workload once untimed (warm-up), then timed (in ``guard``'s window)."""
    sampling = (temperature, top_p)
    _run(engine, ctx, shape, batch, loras, None, *sampling)
    timeline = StepTimeline(engine, ctx.device)
    if guard is None:
        return _run(engine, ctx, shape, batch, loras, timeline, *sampling)
    with guard.window(label):
        return _run(engine, ctx, shape, batch, loras, timeline, *sampling)


def _run(engine, ctx, shape, batch, loras, timeline, temperature=0.0, top_p=1.0) -> StepRun | None:
    from lorapool import SamplingParams

    sizes = ctx.sizes
    seed = SAMPLED_SEED if temperature else None
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        max_tokens=sizes.decode_tokens,
        ignore_eos=True,
    )
    prompts = models.prompts(batch, 16, shape.vocab_size, seed=2)
    for i, prompt in enumerate(prompts):
        lora = loras[i] if loras else None
        engine.add_request(f"dec{i}", {"prompt_token_ids": prompt}, params, lora_request=lora)
    done, contexts = {}, []
    stepper = timeline.__enter__() if timeline else None
    try:
        while engine.has_unfinished_requests():
            decoding = _all_decoding(engine, batch)
            if decoding:
                contexts.append(sum(s.num_computed_tokens + 1 for s in engine.scheduler.running))
            outs = stepper.step(decoding) if stepper else engine.step()
            for out in outs:
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
    finally:
        if timeline:
            timeline.__exit__(None, None, None)
    if timeline is None:
        return None
    walls = [s["step"] for s in timeline.steps]
    kept = walls[2:] or walls
    return StepRun(
        step_s=statistics.median(kept),
        mean_step_s=statistics.fmean(kept),
        tokens=[done[f"dec{i}"] for i in range(batch)],
        context_tokens=statistics.fmean(contexts[2:] or contexts or [0]),
        timeline=timeline.summary(),
    )


def _all_decoding(engine, batch: int) -> bool:
    running = engine.scheduler.running
    return (
        not engine.scheduler.waiting
        and len(running) == batch
        and all(s.num_computed_tokens >= s.num_prompt_tokens for s in running)
    )


def practical_floors(ctx, rec, engine, guard, tag: str = "") -> dict[int, float]:
    """{batch: seconds} of the GEMM-only graph per decode batch; recorded as figures."""
    out = {}
    model = engine.runner.model
    for batch in ctx.sizes.decode_batches:
        try:
            timed = floors.gemm_floor(
                model, batch, ctx.device, window=guard.window(f"{tag}GEMM floor b{batch}")
            )
        except Exception as exc:  # a floor that fails must not cost the section
            rec.check(f"{tag}practical floor at batch {batch} measured", False, repr(exc)[:500])
            continue
        out[batch] = timed["median_s"]
        rec.figure(f"{tag}practical_floor_ms_b{batch}", round(timed["median_s"] * 1e3, 4))
        rec.figure(f"{tag}practical_floor_method", timed["method"])
    return out


def record(ctx, rec, engine, shape, run: StepRun, where: dict, practical: dict) -> None:
    """The figures and timeline row of one configuration ``where`` (label, batch, mode,
    adapters: their directories; tag: a figure prefix)."""
    label, batch, mode, tag = where["label"], where["batch"], where["mode"], where.get("tag", "")
    suffix = f"{label}_b{batch}_{mode}"
    rec.figure(f"{tag}decode_step_ms_{suffix}", round(run.step_s * 1e3, 4))
    itemsize = engine.runner.dtype.itemsize
    lora = floors.adapter_bytes(shape, where.get("adapters", ()), itemsize)
    nbytes, parts = floors.step_bytes(
        engine.runner.model, batch, run.context_tokens, itemsize, lora
    )
    if ctx.copy_gbps:
        floor_s = nbytes / (ctx.copy_gbps * 1e9)
        rec.figure(f"{tag}bytes_floor_ms_{label}_b{batch}", round(floor_s * 1e3, 4))
        rec.figure(f"{tag}step_over_bytes_floor_{suffix}", round(run.step_s / floor_s, 3))
    rec.figure(
        f"{tag}step_bytes_GB_{label}_b{batch}", {k: round(v / 1e9, 4) for k, v in parts.items()}
    )
    if batch in practical:
        rec.figure(
            f"{tag}step_over_practical_floor_{suffix}", round(run.step_s / practical[batch], 3)
        )
    row = {"model": shape.name, "label": label, "batch": batch, "mode": mode, **run.timeline}
    row["implied_tokens_per_s"] = round(batch / run.mean_step_s, 1)
    rec.row(f"{tag}step_timeline", row)


def host_copy_check(ctx, rec) -> None:
    """``engine.host_copy.to_device`` (the sampler's row indices and per-row values) must
    not wait for the kernels queued before it, as a pageable copy does: each copied
    behind ~``QUEUED_MS`` of queued device work (``torch.cuda._sleep``), timed on the
    host. CUDA only."""
    import time

    import torch

    from lorapool.engine.host_copy import to_device

    if ctx.device != "cuda":
        rec.note("host copy check: CUDA only (this run is on the CPU)")
        return
    device, values = torch.device("cuda"), list(range(256))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)  # calibrates the spin: cycles a millisecond
    end.record()
    end.synchronize()
    cycles_per_ms = 10**7 / max(start.elapsed_time(end), 1e-3)
    waits = {}
    for name, copy in (
        ("pinned", lambda: to_device(values, device, torch.long)),
        ("pageable", lambda: torch.tensor(values, dtype=torch.long, device=device)),
    ):
        copy()  # warm: the caching host allocator's first pinned block is slow to get
        torch.cuda.synchronize()
        torch.cuda._sleep(int(QUEUED_MS * cycles_per_ms))
        began = time.perf_counter()
        tensor = copy()
        waits[name] = time.perf_counter() - began
        torch.cuda.synchronize()
        rec.check(f"host copy ({name}) holds its values", tensor.tolist() == values)
        rec.figure(f"host_copy_{name}_waited_ms", round(waits[name] * 1e3, 3))
    rec.check(
        "to_device does not wait for queued kernels",
        waits["pinned"] < 0.2 * QUEUED_MS / 1e3 < waits["pageable"],
        f"pinned {waits['pinned'] * 1e3:.2f} ms, pageable {waits['pageable'] * 1e3:.2f} ms "
        f"behind {QUEUED_MS} ms queued",
    )
