"""Section: launch configurations of the LoRA and attention kernels, swept on the device.

At the shapes the engine runs in its CUDA graphs (the ~1B Llama's decode steps
at each of ``decode_batches``: every LoRA projection at ``max_lora_rank`` over
8 adapters, and paged attention at the graph's block-table reach), each op's
heuristic launch ("old", ``config={}``) and a handful of candidates (the op's
``candidates``, thinned to ``MAX_CANDIDATES`` spread over its list) are:

1. compiled in parallel, one process per core (``_compile_all``): each process
   launches its share once, filling Triton's on-disk cache, so the timing
   process below loads the binaries instead of compiling them; on the CPU
   (interpreted: nothing compiles) they run in this process;
2. checked against the old launch's result (the same up to summation order);
3. timed by graph replay over inputs larger than L2 (``timing.replay_time``),
   no compile inside the window (``CompileGuard``).

A candidate faster than the old launch by more than ``MIN_GAIN`` is the shape's
winner; the winners go to ``<out>/configs/<device>.json`` in the format that
``kernels/tuned.py`` reads (``{"device", "ops": {op: {key: config}}}``), to be
committed as ``kernels/configs/<device>.json``. The ``sweep`` table reports old
against new for every shape. LoRA ops are swept where ``lora_ops`` has the
tuning API (``candidates``, ``config_key``, ``config=``); otherwise a note says so.
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import multiprocessing
import os
import re
from pathlib import Path

import torch

from .sweep_cases import (
    Case,
    attention_cases,
    candidates_of,
    least_bytes,
    lora_cases,
    make_calls,
    pick,
)
from .timing import CompileGuard, replay_time

MIN_GAIN = 0.03  # a winner beats the old launch by more than this share
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def run(ctx, rec) -> None:
    device = ctx.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cases = attention_cases(ctx, dtype) + lora_cases(ctx, dtype, rec)
    rec.figure("device_key", device_key(device))
    rec.figure("cases", len(cases))
    most = ctx.sizes.sweep_candidates
    plans = {case: [{}, *pick(candidates_of(case), most)] for case in cases}
    rec.figure("launches", sum(map(len, plans.values())))
    _compile_all(ctx, rec, plans)
    guard, winners = CompileGuard(), {}
    for case, configs in plans.items():
        if ctx.time_left() < 0:
            rec.cut_short(f"the sweep from {case.op} {case.key} on")
            break
        try:
            best = _sweep_case(ctx, rec, case, configs, guard)
        except Exception as exc:  # one shape's failure must not cost the others
            rec.check(f"{case.op} {case.key} swept", False, repr(exc)[:800])
            continue
        if best is not None:
            winners.setdefault(case.op, {})[case.key] = best
    guard.report(rec, "sweep")
    _write(ctx, rec, winners)
    _acceptance(ctx, rec)


def _acceptance(ctx, rec) -> None:
    """The LoRA kernels' share of the copy bandwidth at the first decode batch: the
    engine's path per projection (lora_linear where there, else shrink + expand)."""
    rows = [r for r in rec.data["tables"].get("sweep", []) if "bw_fraction" in r]
    first = f"t{ctx.sizes.decode_batches[0]}-"
    lora = [r for r in rows if r["op"].startswith("lora") and r["key"].startswith(first)]
    if lora:
        rec.figure(
            "acceptance_lora_decode_bw_fraction",
            {r["key"] + " " + r["op"]: r["bw_fraction"] for r in lora},
        )


# --- the cases --------------------------------------------------------------------


def _compile_all(ctx, rec, plans: dict) -> None:
    """Every launch once, in a pool of processes on a GPU (their binaries land in
    Triton's cache); in this process on the CPU, where nothing compiles."""
    import time

    t0 = time.time()
    jobs = [(case, config) for case, configs in plans.items() for config in configs]
    if ctx.device != "cuda":
        errors = [e for job in jobs for e in _compile_one(job, ctx.device)]
        rec.note("interpreted: nothing compiles, the launches ran once in this process")
    else:
        errors, note = _compile_pool(jobs, ctx)
        rec.note(note)
    rec.figure("compile_s", round(time.time() - t0, 1))
    _drop_failed(rec, plans, errors)


def _drop_failed(rec, plans: dict, errors: list) -> None:
    """A candidate that cannot launch (too much shared memory, say) leaves the sweep with a
    note; the old launch failing is a failed check (the engine runs it)."""
    for case, config, error in errors:
        if config == {}:
            rec.check(f"{case.op} {case.key}: the old launch runs", False, error)
        else:
            rec.note(f"{case.op} {case.key} {config} left out: {error}")
        if config in plans.get(case, []):
            plans[case].remove(config)
    rec.figure("launches_failed", len(errors))


def _compile_pool(jobs, ctx) -> tuple[list[tuple], str]:
    """(errors, a note): the jobs over one spawned process per core (at most 16). A pool
    that fails or runs past its time is left behind: the sweep compiles what is missing
    as it goes (outside its timed windows), one launch after another."""
    workers = max(1, min(len(jobs), os.cpu_count() or 1, 16))
    spawn = multiprocessing.get_context("spawn")
    chunks = [jobs[i::workers] for i in range(workers)]
    pool = futures.ProcessPoolExecutor(workers, mp_context=spawn)
    try:
        timeout = max(20.0, 0.6 * ctx.time_left())
        done = pool.map(_compile_chunk, chunks, [ctx.device] * workers, timeout=timeout)
        errors = [e for found in done for e in found]
        pool.shutdown(wait=True)
        return errors, f"compiled in {workers} processes"
    except Exception as exc:
        pool.shutdown(wait=False, cancel_futures=True)
        return [], f"the compile pool failed ({exc!r:.300}); the sweep compiles as it goes"


def _compile_chunk(jobs, device: str) -> list[tuple]:
    if device == "cuda":
        torch.cuda.set_device(0)
    return [e for job in jobs for e in _compile_one(job, device)]


def _compile_one(job, device: str) -> list[tuple]:
    """[] when the launch ran, else [(case, config, the error)]."""
    case, config = job
    try:
        call, _, _ = make_calls(case, device)
        call(config, 0)()
        if device == "cuda":
            torch.cuda.synchronize()
        return []
    except Exception as exc:
        return [(case, config, f"{exc!r:.300}")]


def _sweep_case(ctx, rec, case: Case, configs: list[dict], guard) -> dict | None:
    call, result, copies = make_calls(case, ctx.device, many=True)
    want = result({}).float()
    scale = max(1.0, want.abs().max().item())
    timings = []
    for config in configs:
        try:
            got = result(config).float()
        except Exception as exc:  # a candidate that cannot run is left out
            if config == {}:
                raise
            rec.note(f"{case.op} {case.key} {config} left out: {exc!r:.300}")
            continue
        err = (got - want).abs().max().item() / scale
        ok = err <= TOLERANCE[getattr(torch, case.spec["dtype"])]
        if not ok:
            rec.check(
                f"{case.op} {case.key} {config}: the old launch's result", False, f"err {err:.3g}"
            )
            continue
        calls = [call(config, i) for i in range(copies)]
        label = f"{case.op} {case.key} {config}"
        timed = replay_time(calls, ctx.device, window=guard.window(label))
        timings.append((timed["median_s"], config))
    old_s = next((s for s, c in timings if c == {}), None)
    if old_s is None:
        return None  # the old launch's own result failed its check: recorded
    best_s, best = min(timings, key=lambda t: t[0])
    winner = best if best and best_s < old_s * (1 - MIN_GAIN) else None
    new_s = best_s if winner else old_s
    row = {
        "op": case.op,
        "key": case.key,
        "old_us": round(old_s * 1e6, 2),
        "new_us": round(new_s * 1e6, 2),
        "speedup": round(old_s / new_s, 3),
        "winner": winner or "old",
        "tried": len(timings),
    }
    if ctx.copy_gbps:  # the least bytes the op moves over its time, as a share of a copy's
        gbps = least_bytes(case) / new_s / 1e9
        row["bw_fraction"] = float(f"{gbps / ctx.copy_gbps:.3g}")
    rec.row("sweep", row)
    return winner


def device_key(device: str) -> str:
    """``kernels/tuned.py``'s file name of the device (the CPU: ``cpu``)."""
    if device != "cuda":
        return "cpu"
    return re.sub(r"[^A-Za-z0-9.-]+", "_", torch.cuda.get_device_name(0)).strip("_")


def _write(ctx, rec, winners: dict) -> None:
    name = torch.cuda.get_device_name(0) if ctx.device == "cuda" else "cpu"
    path = Path(ctx.out or ctx.workdir) / "configs" / f"{device_key(ctx.device)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": name, "ops": winners}, indent=1, sort_keys=True) + "\n")
    rec.figure("configs_file", str(path))
    rec.figure("winners", sum(map(len, winners.values())))
