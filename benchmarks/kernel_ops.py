"""Kernel benchmark: the Triton kernels against the torch reference on one CUDA device.

For decode-sized (1 to 256 tokens) and prefill-sized (2k to 8k tokens) calls
of each op (LoRA shrink and expand on a packed q/k/v projection, paged
attention, KV cache writes) it prints the achieved GB/s and TFLOP/s, their
share of the device's peak, and the speed-up over ``kernels/reference.py``
run on the same GPU. Each kernel's output is first checked against the
reference. Bytes are the least traffic an op needs (every input read once,
every output written once); FLOPs count multiply-adds as two.

    .venv/bin/python benchmarks/kernel_ops.py [--model smollm2 --model llama-8b]
        [--dtype bfloat16] [--peak-gbps 3350 --peak-tflops 989] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

from lorapool import kernels
from lorapool.kernels import LoRAMapping, attention_ops, lora_ops, reference


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_size: int


SHAPES = {"smollm2": Shape(576, 9, 3, 64), "llama-8b": Shape(4096, 32, 8, 128)}
# (memory GB/s, dense bf16 tensor TFLOP/s) by a part of the device name.
PEAKS = {
    "H200": (4800, 989),
    "H100 PCIe": (2000, 756),
    "H100": (3350, 989),
    "A100-SXM4-80GB": (2039, 312),
    "A100": (1555, 312),
    "L40S": (864, 362),
    "A10G": (600, 125),
    "L4": (300, 121),
}
DECODE_TOKENS = (1, 16, 64, 256)
PREFILL_TOKENS = (2048, 4096, 8192)
RANK, NUM_ADAPTERS, BLOCK_SIZE = 16, 8, 16
DEVICE = "cuda"


@dataclass
class Row:
    op: str
    case: str
    ms: float
    ref_ms: float
    gbytes: float
    gflops: float
    ok: bool


def _timed(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50)


def _row(op, case, kernel, ref, gbytes, gflops, check) -> Row:
    ok = check()
    return Row(op, case, _timed(kernel), _timed(ref), gbytes, gflops, ok)


def _close(a, b, dtype) -> bool:
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _lora_rows(shape: Shape, tokens: int, dtype, popularity: str) -> list[Row]:
    dev, esize = DEVICE, torch.finfo(dtype).bits // 8
    widths = (shape.heads * shape.head_size, *(2 * [shape.kv_heads * shape.head_size]))
    adapters = tokens if popularity == "distinct" else NUM_ADAPTERS
    slots = (
        torch.randint(adapters, (tokens,)) if popularity == "uniform" else torch.randperm(adapters)
    )
    mapping = LoRAMapping.from_slots(slots, dev)
    active = len(mapping.segments)
    x = torch.randn(tokens, shape.hidden, device=dev, dtype=dtype)
    a = torch.randn(3, adapters, RANK, shape.hidden, device=dev, dtype=dtype) * 0.05
    b = torch.randn(adapters, sum(widths), RANK, device=dev, dtype=dtype) * 0.05
    out = torch.randn(tokens, sum(widths), device=dev, dtype=dtype)
    y = reference.lora_shrink(x, a, mapping)
    case = f"{tokens} tok, {popularity} over {active}"
    shrink_bytes = (
        tokens * shape.hidden + active * 3 * RANK * shape.hidden
    ) * esize + 3 * tokens * RANK * 4
    expand_bytes = 3 * tokens * RANK * 4 + (active * RANK + 2 * tokens) * sum(widths) * esize
    return [
        _row(
            "lora_shrink qkv",
            case,
            lambda: lora_ops.lora_shrink(x, a, mapping),
            lambda: reference.lora_shrink(x, a, mapping),
            shrink_bytes / 1e9,
            2 * tokens * shape.hidden * RANK * 3 / 1e9,
            lambda: _close(lora_ops.lora_shrink(x, a, mapping), y, torch.float32),
        ),
        _row(
            "lora_expand qkv",
            case,
            lambda: lora_ops.lora_expand(y, b, mapping, out, widths),
            lambda: reference.lora_expand(y, b, mapping, out, widths),
            expand_bytes / 1e9,
            2 * tokens * sum(widths) * RANK / 1e9,
            lambda: _check_expand(y, b, mapping, widths, out, dtype),
        ),
        *(
            _row(
                f"lora_linear qkv {name}",
                case,
                lambda live=live: kernels.lora_linear(x, a, b, mapping, out, widths, live),
                lambda: reference.lora_expand(
                    reference.lora_shrink(x, a, mapping), b, mapping, out, widths
                ),
                (shrink_bytes + expand_bytes) / 1e9,
                2 * tokens * RANK * (3 * shape.hidden + sum(widths)) / 1e9,
                lambda live=live: _check_linear(x, a, b, y, mapping, widths, out, dtype, live),
            )
            # EngineArgs.lora_live_work off (shrink, zeroing, sum, expand) and on (2 launches)
            for name, live in (("5 launches", False), ("live work", True))
        ),
    ]


def _check_linear(x, a, b, y, mapping, widths, out, dtype, live_work: bool) -> bool:
    got, want = out.clone(), out.clone()
    kernels.lora_linear(x, a, b, mapping, got, widths, live_work)
    reference.lora_expand(y, b, mapping, want, widths)
    return _close(got, want, dtype)


def _check_expand(y, b, mapping, widths, out, dtype) -> bool:
    got, want = out.clone(), out.clone()
    lora_ops.lora_expand(y, b, mapping, got, widths)
    reference.lora_expand(y, b, mapping, want, widths)
    return _close(got, want, dtype)


def _attention_inputs(shape: Shape, q_lens: list[int], ctx_lens: list[int], dtype):
    dev = DEVICE
    blocks = [-(-c // BLOCK_SIZE) for c in ctx_lens]
    perm = torch.randperm(sum(blocks), device=dev).int()
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device=dev)
    for i, start in enumerate(torch.tensor([0, *blocks]).cumsum(0)[:-1].tolist()):
        tables[i, : blocks[i]] = perm[start : start + blocks[i]]
    cache_shape = (sum(blocks), BLOCK_SIZE, shape.kv_heads, shape.head_size)
    k_cache = torch.randn(cache_shape, device=dev, dtype=dtype)
    v_cache = torch.randn(cache_shape, device=dev, dtype=dtype)
    q = torch.randn(sum(q_lens), shape.heads, shape.head_size, device=dev, dtype=dtype)
    qsl = torch.tensor([0, *q_lens], device=dev).cumsum(0).int()
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, tables, seq_lens, qsl


def _attention_row(shape: Shape, q_lens, ctx_lens, dtype, case: str) -> Row:
    args = _attention_inputs(shape, q_lens, ctx_lens, dtype)
    esize, scale = torch.finfo(dtype).bits // 8, shape.head_size**-0.5
    kv_bytes = 2 * sum(ctx_lens) * shape.kv_heads * shape.head_size * esize
    qo_bytes = 2 * sum(q_lens) * shape.heads * shape.head_size * esize
    # Each query attends to its position + 1 keys: QK^T and PV, 2 FLOPs per MAC each.
    keys = sum(sum(c - q + i + 1 for i in range(q)) for q, c in zip(q_lens, ctx_lens))
    flops = 4 * keys * shape.heads * shape.head_size
    return _row(
        "paged_attention",
        case,
        lambda: attention_ops.paged_attention(*args, scale),
        lambda: reference.paged_attention(*args, scale),
        (kv_bytes + qo_bytes) / 1e9,
        flops / 1e9,
        lambda: _close(
            attention_ops.paged_attention(*args, scale),
            reference.paged_attention(*args, scale),
            dtype,
        ),
    )


def _write_row(shape: Shape, tokens: int, dtype) -> Row:
    dev, esize = DEVICE, torch.finfo(dtype).bits // 8
    k = torch.randn(tokens, shape.kv_heads, shape.head_size, device=dev, dtype=dtype)
    cache_shape = (-(-tokens // BLOCK_SIZE) * 2, BLOCK_SIZE, shape.kv_heads, shape.head_size)
    caches = [torch.zeros(cache_shape, device=dev, dtype=dtype) for _ in range(4)]
    slots = torch.randperm(cache_shape[0] * BLOCK_SIZE, device=dev)[:tokens]

    def check():
        attention_ops.write_kv_cache(k, k, caches[0], caches[1], slots)
        reference.write_kv_cache(k, k, caches[2], caches[3], slots)
        return torch.equal(caches[0], caches[2])

    return _row(
        "write_kv_cache",
        f"{tokens} tok",
        lambda: attention_ops.write_kv_cache(k, k, caches[0], caches[1], slots),
        lambda: reference.write_kv_cache(k, k, caches[2], caches[3], slots),
        4 * k.numel() * esize / 1e9,
        0.0,
        check,
    )


def _rows(shape: Shape, dtype) -> list[Row]:
    rows = []
    for tokens in DECODE_TOKENS + PREFILL_TOKENS:
        rows += _lora_rows(shape, tokens, dtype, "uniform")
    rows += _lora_rows(shape, 64, dtype, "distinct")
    for seqs in DECODE_TOKENS:
        for ctx in (1024, 8192) if seqs <= 16 else (1024,):
            rows.append(
                _attention_row(
                    shape, [1] * seqs, [ctx] * seqs, dtype, f"decode {seqs} seq x {ctx} ctx"
                )
            )
    for tokens in PREFILL_TOKENS:
        rows.append(_attention_row(shape, [tokens], [tokens], dtype, f"prefill {tokens} tok"))
    rows.append(_attention_row(shape, [2048], [6144], dtype, "prefill 2048 on 4096 cached"))
    rows += [_write_row(shape, tokens, dtype) for tokens in (64, 8192)]
    return rows


def _peaks(args) -> tuple[float, float]:
    name = torch.cuda.get_device_name()
    gbps, tflops = next((p for key, p in PEAKS.items() if key in name), (0.0, 0.0))
    return args.peak_gbps or gbps, args.peak_tflops or tflops


def _print(model: str, rows: list[Row], peaks: tuple[float, float]) -> None:
    gbps_peak, tflops_peak = peaks
    print(f"\n### {model}\n")
    print("| op | case | Triton µs | GB/s | % peak BW | TFLOP/s | % peak FLOP | vs reference |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        gbps, tflops = r.gbytes / r.ms * 1e3, r.gflops / r.ms
        bw = f"{100 * gbps / gbps_peak:.0f}%" if gbps_peak else "?"
        fl = f"{100 * tflops / tflops_peak:.1f}%" if tflops_peak else "?"
        flag = "" if r.ok else " **MISMATCH**"
        print(
            f"| {r.op} | {r.case} | {r.ms * 1e3:.1f} | {gbps:.0f} | {bw} | {tflops:.2f} | "
            f"{fl} | {r.ref_ms / r.ms:.1f}x{flag} |"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--peak-gbps", type=float, default=0.0, help="device memory GB/s")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="dense TFLOP/s")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/kernel_ops.py needs a CUDA device: none is visible "
            "(torch.cuda.is_available() is False). Nothing was measured.",
            file=sys.stderr,
        )
        return 2
    torch.manual_seed(0)
    dtype, peaks = getattr(torch, args.dtype), _peaks(args)
    print(
        f"{torch.cuda.get_device_name()}, {args.dtype}, peaks {peaks[0]:.0f} GB/s "
        f"{peaks[1]:.0f} TFLOP/s; LoRA rank {RANK}, KV block size {BLOCK_SIZE}"
    )
    results = {}
    for model in args.model or ["smollm2", "llama-8b"]:
        results[model] = _rows(SHAPES[model], dtype)
        _print(model, results[model], peaks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({m: [vars(r) for r in rows] for m, rows in results.items()}, f, indent=1)
    return 0 if all(r.ok for rows in results.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
