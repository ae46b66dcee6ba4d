"""Section 2: the Triton kernels against ``kernels/reference.py``, then their bandwidth.

Every case runs the Triton kernel (compiled on a GPU; on the CPU the process is
started with TRITON_INTERPRET=1) and the reference on the same inputs and
device, in fp16, bf16 and fp32. The shapes are ones the CPU tests do not use:
ranks 8-64, 1-64 adapter slots, hidden sizes 2048 and 4096 and sizes that are
no power of two, decode and prefill batches. Error: max |kernel - reference|
over max(1, max |reference|). Cases marked timed also give the kernel's
achieved bandwidth (the least bytes the op must move over its median time) as
a fraction of the copy bandwidth of section 1: timed by replaying a CUDA graph
of one call per copy of the inputs, enough copies to outgrow L2, at least 50
timed replays, nothing but the calls in the window (``timing.replay_time``),
and no Triton compile inside it (``timing.CompileGuard``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorapool.kernels import LoRAMapping, attention_ops, jit, kv_cache_ops, lora_ops, reference

from .timing import CompileGuard, copies_for, replay_time

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class LoraCase:
    name: str
    hidden: int
    widths: tuple[int, ...]
    rank: int
    slots: int
    tokens: int
    base_share: float = 0.0  # share of tokens without an adapter (slot -1)
    timed: bool = False


@dataclass(frozen=True)
class AttnCase:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (new tokens, context including them)
    heads: int
    kv_heads: int
    head_size: int
    block_size: int = 16
    timed: bool = False


def _decode(n, ctx_of):
    return tuple((1, ctx_of(i)) for i in range(n))


LORA_FULL = (
    LoraCase("decode qkv h4096 r16 64 slots", 4096, (4096, 1024, 1024), 16, 64, 64, timed=True),
    LoraCase("decode h2048 r64 8 slots T37", 2048, (2048,), 64, 8, 37, base_share=0.3),
    LoraCase("decode h2560 r24 5 slots T1", 2560, (6912, 6912), 24, 5, 1),
    LoraCase("prefill qkv h2048 r8 4 slots", 2048, (2048, 512, 512), 8, 4, 1000, 0.2, timed=True),
    LoraCase("prefill h4096 r32 16 slots T777", 4096, (11008,), 32, 16, 777),
)
ATTN_FULL = (
    AttnCase(
        "decode 64 seqs h32/8 d128",
        _decode(64, lambda i: 1 + (i * 37) % 2000),
        32,
        8,
        128,
        timed=True,
    ),
    AttnCase("decode 1 seq ctx4097 h16/8 d128", ((1, 4097),), 16, 8, 128),
    AttnCase("decode 13 seqs h9/3 d64 bs32", _decode(13, lambda i: 3 + 61 * i), 9, 3, 64, 32),
    AttnCase(
        "prefill 3 seqs h32/8 d128", ((300, 300), (17, 67), (1000, 1000)), 32, 8, 128, timed=True
    ),
    AttnCase("mixed decode+prefill h16/8 d128", ((1, 500), (129, 129), (1, 9)), 16, 8, 128),
)
LORA_TINY = (
    LoraCase("decode qkv h64 r8 3 slots", 64, (64, 32, 32), 8, 3, 5, timed=True),
    LoraCase("prefill h96 r12 2 slots T19", 96, (80,), 12, 2, 19, base_share=0.3),
)
ATTN_TINY = (
    AttnCase("decode 3 seqs h4/2 d16", ((1, 5), (1, 20), (1, 33)), 4, 2, 16, timed=True),
    AttnCase("prefill h6/2 d32", ((7, 7), (3, 12)), 6, 2, 32, 8),
)


def run(ctx, rec) -> None:
    device = ctx.device
    mode = "interpreted" if jit.interpreting() else "compiled"
    rec.figure("triton_mode", mode)
    want = "interpreted" if device == "cpu" else "compiled"
    rec.check(f"Triton kernels run {want}", mode == want, mode)
    lora, attn = (LORA_TINY, ATTN_TINY) if ctx.tiny else (LORA_FULL, ATTN_FULL)
    gen = torch.Generator(device=device).manual_seed(0)
    ctx.guard = CompileGuard()
    for dtype in DTYPES:
        for case in (*lora, *attn, "kv"):
            if ctx.time_left() < 0:
                rec.cut_short(f"the cases from {dtype} {case} on")
                return
            row = _run_case(case, dtype, device, gen, ctx)
            rec.row("cases", row)
            rec.check(f"{row['op']} {row['case']} {row['dtype']}", row["ok"], f"err {row['err']}")
    rec.figure("max_err_by_dtype", _max_errors(rec.data["tables"].get("cases", [])))
    ctx.guard.report(rec, "kernels")
    fractions = [
        r["bw_fraction"] for r in rec.data["tables"].get("cases", []) if "bw_fraction" in r
    ]
    if fractions:
        rec.figure("best_bandwidth_fraction", max(fractions))
    lora = [
        r["bw_fraction"]
        for r in rec.data["tables"].get("cases", [])
        if r["op"] == "lora" and r["case"].startswith("decode") and "bw_fraction" in r
    ]
    if lora:  # the LoRA kernels' share of the copy bandwidth at decode shapes (bf16 first)
        rec.figure("lora_decode_bw_fraction", lora[0])


def _run_case(case, dtype, device, gen, ctx) -> dict:
    if case == "kv":
        return _kv_case(dtype, device, gen, 16 if ctx.tiny else 1000)
    if isinstance(case, LoraCase):
        return _lora_case(case, dtype, device, gen, ctx)
    return _attn_case(case, dtype, device, gen, ctx)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    scale = max(1.0, want.float().abs().max().item())
    return (got.float() - want.float()).abs().max().item() / scale


def _row(op, name, dtype, err, extra=None) -> dict:
    row = {"op": op, "case": name, "dtype": str(dtype).removeprefix("torch.")}
    row |= {"err": float(f"{err:.3g}"), "ok": err <= TOLERANCE[dtype]}
    return row | (extra or {})


def _lora_case(c: LoraCase, dtype, device, gen, ctx) -> dict:
    randn = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    x = randn(c.tokens, c.hidden).to(dtype)
    a = (randn(len(c.widths), c.slots, c.rank, c.hidden) / c.hidden**0.5).to(dtype)
    b = (randn(c.slots, sum(c.widths), c.rank) / c.rank**0.5).to(dtype)
    slots = torch.randint(0, c.slots, (c.tokens,), generator=gen, device=device)
    base = torch.rand(c.tokens, generator=gen, device=device) < c.base_share
    slots = torch.where(base, torch.full_like(slots, -1), slots)
    mapping = LoRAMapping.from_slots(slots.cpu().tolist(), device)
    out0 = randn(c.tokens, sum(c.widths)).to(dtype)

    def kernel():
        out = out0.clone()
        lora_ops.lora_expand(lora_ops.lora_shrink(x, a, mapping), b, mapping, out, c.widths)
        return out

    want = out0.clone()
    reference.lora_expand(reference.lora_shrink(x, a, mapping), b, mapping, want, c.widths)
    row = _row("lora", c.name, dtype, _err(kernel(), want))
    if c.timed:
        used = len({s for s in mapping.host_slots if s >= 0})
        nbytes = dtype.itemsize * (
            x.numel() + used * (a[:, 0].numel() + b[0].numel()) + 2 * out0.numel()
        )
        tensors = (x, a, b, out0)
        n = copies_for(sum(t.numel() * t.element_size() for t in tensors), device)

        def call_on(x, a, b, out):  # accumulates into out: a timing, not a result
            return lambda: lora_ops.lora_expand(
                lora_ops.lora_shrink(x, a, mapping), b, mapping, out, c.widths
            )

        calls = [call_on(*(t.clone() for t in tensors)) for _ in range(n)]
        row |= _bandwidth(calls, nbytes, device, ctx, f"lora {c.name} {row['dtype']}")
    return row


def _attn_case(c: AttnCase, dtype, device, gen, ctx) -> dict:
    counts = [-(-context // c.block_size) for _, context in c.seqs]
    num_blocks = sum(counts) + 2
    perm = (torch.randperm(num_blocks - 2, generator=gen, device=device) + 1).tolist()
    tables = torch.zeros(len(counts), max(counts), dtype=torch.int32)
    for i, n in enumerate(counts):
        tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    shape = (num_blocks, c.block_size, c.kv_heads, c.head_size)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    num_tokens = sum(q for q, _ in c.seqs)
    query = torch.randn(num_tokens, c.heads, c.head_size, generator=gen, device=device).to(dtype)
    starts = [0]
    for q, _ in c.seqs:
        starts.append(starts[-1] + q)
    args = (
        query,
        k_cache,
        v_cache,
        tables.to(device),
        torch.tensor([ctx_len for _, ctx_len in c.seqs], dtype=torch.int32, device=device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        c.head_size**-0.5,
    )
    want = reference.paged_attention(*args)
    row = _row("attention", c.name, dtype, _err(attention_ops.paged_attention(*args), want))
    if c.timed:
        context = sum(ctx_len for _, ctx_len in c.seqs)
        nbytes = dtype.itemsize * (2 * context * c.kv_heads * c.head_size + 2 * query.numel())
        n = copies_for(sum(t.numel() * t.element_size() for t in args[:3]), device)

        def call_on(q, k, v):
            return lambda: attention_ops.paged_attention(q, k, v, *args[3:])

        calls = [call_on(*(t.clone() for t in args[:3])) for _ in range(n)]
        row |= _bandwidth(calls, nbytes, device, ctx, f"attention {c.name} {row['dtype']}")
    return row


def _kv_case(dtype, device, gen, tokens: int) -> dict:
    block_size, heads, size = 16, 8, 128
    num_blocks = tokens // block_size + 4
    cache = torch.zeros(num_blocks, block_size, heads, size, dtype=dtype, device=device)
    key = torch.randn(tokens, heads, size, generator=gen, device=device).to(dtype)
    value = torch.randn(tokens, heads, size, generator=gen, device=device).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:tokens]
    slots[::7] = -1  # padding: skipped by the kernel
    k_got, v_got = cache.clone(), cache.clone()
    kv_cache_ops.write_kv_cache(key, value, k_got, v_got, slots)
    keep = slots >= 0
    k_want, v_want = cache.clone(), cache.clone()
    reference.write_kv_cache(key[keep], value[keep], k_want, v_want, slots[keep])
    err = max(_err(k_got, k_want), _err(v_got, v_want))
    return _row("write_kv_cache", f"{tokens} tokens, every 7th padding", dtype, err)


def _bandwidth(calls, nbytes: int, device: str, ctx, label: str) -> dict:
    timed = replay_time(calls, device, window=ctx.guard.window(label))
    seconds = timed["median_s"]
    gbps = nbytes / seconds / 1e9
    out = {"us": round(seconds * 1e6, 2), "GBps": float(f"{gbps:.4g}")}
    out |= {"samples": timed["samples"], "copies": len(calls)}
    out["p90_us"] = round(timed["p90_s"] * 1e6, 2)
    if ctx.copy_gbps:
        out["bw_fraction"] = float(f"{gbps / ctx.copy_gbps:.3g}")
    return out


def _max_errors(rows: list[dict]) -> dict:
    worst: dict[str, float] = {}
    for row in rows:
        worst[row["dtype"]] = max(worst.get(row["dtype"], 0.0), row["err"])
    return worst
