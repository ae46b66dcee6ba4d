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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .timing import CompileGuard, copies_for, replay_time

MAX_CANDIDATES = 6  # per op and shape, besides the old launch
MIN_GAIN = 0.03  # a winner beats the old launch by more than this share
ADAPTERS = 8  # adapters in a swept LoRA call, tokens round-robin over them
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Case:
    """One op at one shape: ``spec`` is what builds its inputs (picklable)."""

    op: str
    key: str
    spec: dict = field(hash=False)


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


def _shape(ctx):
    return ctx.sizes.models[0]


def attention_cases(ctx, dtype) -> list[Case]:
    from lorapool.kernels import attention_ops

    shape = _shape(ctx)
    head_size = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    reach = shape.max_position_embeddings  # a graph's block tables reach max_model_len
    context = min(1024, reach // 4)  # each sequence's context in the timed calls
    out = []
    for tokens in ctx.sizes.decode_batches:
        spec = dict(
            tokens=tokens,
            heads=shape.num_attention_heads,
            kv_heads=shape.num_key_value_heads,
            head_size=head_size,
            context=context,
            reach=reach,
            block_size=16,
            dtype=str(dtype).removeprefix("torch."),
        )
        key = attention_ops.config_key(
            tokens, tokens, spec["heads"], spec["kv_heads"], head_size, reach, dtype
        )
        out.append(Case("paged_attention", key, spec))
    return out


def lora_cases(ctx, dtype, rec) -> list[Case]:
    from lorapool.kernels import lora_ops

    if not all(hasattr(lora_ops, name) for name in ("candidates", "config_key")):
        rec.note("LoRA ops not swept: lora_ops has no candidates/config_key (tuning API) here")
        return []
    shape, rank = _shape(ctx), ctx.sizes.adapter_rank
    head_size = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    q, kv = shape.num_attention_heads * head_size, shape.num_key_value_heads * head_size
    hidden, inter = shape.hidden_size, shape.intermediate_size
    projections = {  # the engine's packed projections: (H_in, slice widths)
        "qkv": (hidden, (q, kv, kv)),
        "o": (q, (hidden,)),
        "gate_up": (hidden, (inter, inter)),
        "down": (inter, (hidden,)),
    }
    ops = [op for op in ("lora_shrink", "lora_expand", "lora_linear") if hasattr(lora_ops, op)]
    out, seen = [], set()
    for tokens in ctx.sizes.decode_batches:
        for name, (h_in, widths) in projections.items():
            spec = dict(
                tokens=tokens,
                hidden=h_in,
                widths=list(widths),
                rank=rank,
                dtype=str(dtype).removeprefix("torch."),
                projection=name,
            )
            for op in ops:
                shrink = op != "lora_expand"
                key = lora_ops.config_key(
                    tokens,
                    rank,
                    len(widths),
                    hidden=h_in if shrink else None,
                    widths=None if op == "lora_shrink" else widths,
                )
                if (op, key) not in seen:  # o and down expand alike: one key
                    seen.add((op, key))
                    out.append(Case(op, key, spec))
    return out


def candidates_of(case: Case) -> list[dict]:
    from lorapool.kernels import attention_ops, lora_ops

    if case.op == "paged_attention":
        return attention_ops.candidates(1)
    spec = case.spec
    hidden = None if case.op == "lora_expand" else spec["hidden"]
    widths = None if case.op == "lora_shrink" else spec["widths"]
    return lora_ops.candidates(case.op, hidden=hidden, widths=widths)


def pick(configs: list[dict], most: int = MAX_CANDIDATES) -> list[dict]:
    """At most ``most`` of ``configs``, spread evenly over the list (first and last in)."""
    if len(configs) <= most:
        return list(configs)
    if most == 1:
        return [configs[len(configs) // 2]]
    step = (len(configs) - 1) / (most - 1)
    return [configs[round(i * step)] for i in range(most)]


# --- inputs and calls -------------------------------------------------------------


def make_calls(case: Case, device: str, many: bool = False, seed: int = 0):
    """(call(config, i) -> a thunk of the op on copy i, result(config) -> a fresh output,
    copies): one copy of the inputs, or (``many``) enough to outgrow L2 (``copies_for``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, case.spec["dtype"])
    build = _attention_calls if case.op == "paged_attention" else _lora_calls
    return build(case, device, dtype, gen, many)


def _copies(inputs, device: str, many: bool) -> list:
    """One set of inputs, then as many more as L2 asks for (when ``many``)."""
    first = inputs()
    if not many:
        return [first]
    nbytes = sum(t.numel() * t.element_size() for t in first)
    return [first] + [inputs() for _ in range(copies_for(nbytes, device) - 1)]


def _attention_calls(case, device, dtype, gen, many):
    spec = case.spec
    from lorapool.kernels import attention_ops

    tokens, bs = spec["tokens"], spec["block_size"]
    per_seq = -(-spec["context"] // bs)
    num_blocks = tokens * per_seq + 1
    tables = torch.zeros(tokens, spec["reach"] // bs, dtype=torch.int32, device=device)
    tables[:, :per_seq] = 1 + torch.arange(tokens * per_seq, device=device).view(tokens, per_seq)
    seq_lens = torch.full((tokens,), spec["context"], dtype=torch.int32, device=device)
    qsl = torch.arange(tokens + 1, dtype=torch.int32, device=device)
    cache_shape = (num_blocks, bs, spec["kv_heads"], spec["head_size"])

    def inputs():
        q = torch.randn(tokens, spec["heads"], spec["head_size"], generator=gen, device=device)
        k = torch.randn(cache_shape, generator=gen, device=device)
        v = torch.randn(cache_shape, generator=gen, device=device)
        return q.to(dtype), k.to(dtype), v.to(dtype)

    sets = _copies(inputs, device, many)
    scale = spec["head_size"] ** -0.5

    def call(config, i):
        q, k, v = sets[i]
        return lambda: attention_ops.paged_attention(q, k, v, tables, seq_lens, qsl, scale, config)

    return call, lambda config: call(config, 0)(), len(sets)


def _lora_calls(case, device, dtype, gen, many):
    from lorapool.kernels import LoRAMapping, lora_ops

    spec = case.spec
    tokens, hidden, widths, rank = spec["tokens"], spec["hidden"], spec["widths"], spec["rank"]
    slices, n = len(widths), sum(widths)
    mapping = LoRAMapping.from_slots([i % ADAPTERS for i in range(tokens)], device)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    def inputs():
        x = randn(tokens, hidden)
        a = randn(ADAPTERS, slices, rank, hidden, scale=hidden**-0.5).transpose(
            0, 1
        )  # [S, L, R, H]
        b = randn(ADAPTERS, rank, n, scale=rank**-0.5).transpose(1, 2)  # [L, N, R]
        y = torch.randn(slices, tokens, rank, generator=gen, device=device)
        out = torch.zeros(tokens, n, dtype=dtype, device=device)
        shrunk = torch.empty(slices, tokens, rank, dtype=torch.float32, device=device)
        return x, a, b, y, out, shrunk

    sets = _copies(inputs, device, many)

    def call(config, i):
        x, a, b, y, out, shrunk = sets[i]
        if case.op == "lora_shrink":
            return lambda: lora_ops.lora_shrink(x, a, mapping, 1.0, shrunk, config=config)
        if case.op == "lora_expand":
            return lambda: lora_ops.lora_expand(y, b, mapping, out, widths, config=config)
        return lambda: lora_ops.lora_linear(x, a, b, mapping, out, widths, config=config)

    def result(config):
        x, a, b, y, out, shrunk = sets[0]
        if case.op == "lora_shrink":
            return lora_ops.lora_shrink(x, a, mapping, 1.0, shrunk.clone(), config=config)
        fresh = torch.zeros_like(out)
        if case.op == "lora_expand":
            lora_ops.lora_expand(y, b, mapping, fresh, widths, config=config)
        else:
            lora_ops.lora_linear(x, a, b, mapping, fresh, widths, config=config)
        return fresh

    return call, result, len(sets)


# --- compile, check, time ---------------------------------------------------------


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


def least_bytes(case: Case) -> int:
    """Bytes the op must read and write at least: each tensor once, adapters' weights
    once per adapter, the output read and written where it accumulates."""
    spec = case.spec
    item = getattr(torch, spec["dtype"]).itemsize
    if case.op == "paged_attention":
        kv = 2 * spec["tokens"] * spec["context"] * spec["kv_heads"] * spec["head_size"]
        return item * (kv + 2 * spec["tokens"] * spec["heads"] * spec["head_size"])
    tokens, hidden, rank = spec["tokens"], spec["hidden"], spec["rank"]
    slices, n = len(spec["widths"]), sum(spec["widths"])
    adapters = min(ADAPTERS, tokens)
    x, a, y = (
        tokens * hidden * item,
        adapters * slices * rank * hidden * item,
        4 * slices * tokens * rank,
    )
    b, out = adapters * n * rank * item, 2 * tokens * n * item
    return {"lora_shrink": x + a + y, "lora_expand": y + b + out}.get(case.op, x + a + b + out)


# --- the configs file -------------------------------------------------------------


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
