"""Triton kernels for mixed-adapter LoRA: shrink (x @ A^T) and expand (y @ B^T).

One kernel per op serves prefill and decode alike. Tokens are grouped by
adapter (``LoRAMapping``) and cut into tiles of ``block_m`` tokens of one
adapter; a program owns one tile and gathers its token rows through the sort
order. A prefill segment is then a run of full matrix tiles; a decode token
alone with its adapter is a tile with one live row. Decode LoRA is bound by
reading the adapter's weights, which a tile reads once for all its rows, as a
gather-GEMV would; the unused MMA rows cost compute that a memory-bound call
has to spare. So a second, GEMV-only kernel would add code without saving
traffic (``benchmarks/kernel_ops.py`` measures the distinct-adapter decode case
that would show otherwise). Tokens with slot -1 are in no tile, so no program
ever reads a weight for them, least of all the last slot's. A tile with no
token (start == end: the padding tiles of a CUDA graph, ``engine/cuda_graphs``)
returns before it loads anything, in both kernels and on every path: it changes
no result, only the work an empty program does.

Shrink splits the H_in reduction over SPLIT_K programs when the tiles alone
would leave the device idle (decode). Each split stores its partial sum in a
buffer of its own and the partials are added in a fixed order, so greedy
decoding with adapters repeats itself bit for bit: atomic adds, whose order
varies from run to run, made a bf16 decode of 64 sequences with 8 adapters
repeat exactly in only 20 of 64 sequences on an H200 (benchmarks/RESULTS.md).

Two ways to run a projection's update (``kernels.lora_linear``):

- ``lora_shrink`` then ``lora_expand`` (the public ops, and the engine's path
  while ``EngineArgs.lora_live_work`` is off): shrink zeroes y, zeroes one
  partial per split, launches, sums the partials with ``torch.sum``; expand
  launches. Five launches a projection when the reduction is split.
- ``lora_linear`` (the flag on): two launches. The shrink writes each split's
  partial into its own slice of an ``empty`` [SPLIT_K, S, T, R] fp32 buffer:
  only the rows of tokens in tiles, which are the only rows the expand reads;
  the expand adds the SPLIT_K partials, in split order, as it loads y. SPLIT_K
  comes from the tiles that have work (``LoRAMapping.work_tiles``: a graph's
  expected live tiles, not its padded count).

Shrink and expand are not fused into one kernel: at decode shapes the shrink
needs SPLIT_K programs per tile to keep the device's memory busy, and a fused
program would then have to wait for the other splits (a grid-wide dependency,
or atomics, whose order is not repeatable), or run without a split, one
program per tile reading all of A and B. The second launch costs a few
microseconds eagerly and nearly nothing inside a CUDA graph; the partials it
reads were written just before and sit in L2.

Launch configurations (``lora_configs``, re-exported here): each wrapper takes
``config``, a dict of some of BLOCK_K, SPLIT_K, BLOCK_N, num_warps, num_stages;
None: the device's measured entry (``kernels.tuned``) for the op at
``config_key(...)`` of the call, else the heuristics here. ``candidates(op, ...)``
lists what a sweep times for one shape.
"""

import torch
import triton
import triton.language as tl

from lorapool.kernels import jit, lora_checks
from lorapool.kernels.lora_configs import candidates, config_key, launch_options, resolve
from lorapool.kernels.lora_mapping import LoRAMapping, as_mapping

__all__ = ["candidates", "config_key", "lora_expand", "lora_linear", "lora_shrink"]

MAX_SPLIT_K = 8


@triton.jit
def _bounds(tiles_ptr, num_tiles):
    """This program's tile: its first and end position in the token order."""
    tile = tl.program_id(0)
    return tl.load(tiles_ptr + tile), tl.load(tiles_ptr + num_tiles + tile)


@triton.jit
def _rows(tiles_ptr, order_ptr, num_tiles, start, end, BLOCK_M: tl.constexpr):
    """The tile's slot, its token rows [BLOCK_M] and which of them exist."""
    slot = tl.load(tiles_ptr + 2 * num_tiles + tl.program_id(0))
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(order_ptr + offs_m, mask=mask_m, other=0)
    return slot, rows, mask_m


def _shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    order_ptr,
    tiles_ptr,
    num_tiles,
    hidden,
    rank,
    scale,
    stride_xt,
    stride_as,
    stride_al,
    stride_ar,
    stride_yk,
    stride_ys,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """y[k, s, t] = scale * sum over the k-th split of H_in of x[t] @ A[s, slot]^T, for the
    tokens t of one tile of one slot.

    Grid (tile, slice s, k-split): a program sums BLOCK_K columns of H_in out of
    every BLOCK_K * SPLIT_K into its own partial y[k] of y [SPLIT_K, S, T, R] fp32
    (with no split, y may be the [S, T, R] output itself). Only the rows of the
    tile's tokens are written; an empty tile writes nothing.
    """
    start, end = _bounds(tiles_ptr, num_tiles)
    if start < end:
        s = tl.program_id(1)
        pid_k = tl.program_id(2)
        slot, rows, mask_m = _rows(tiles_ptr, order_ptr, num_tiles, start, end, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        x_rows = x_ptr + rows[:, None] * stride_xt
        a_base = a_ptr + s * stride_as + slot * stride_al + offs_r[None, :] * stride_ar
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)  # y rows of the tile
        for k0 in range(pid_k * BLOCK_K, hidden, BLOCK_K * SPLIT_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < hidden
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            a = tl.load(a_base + offs_k[:, None], mask=mask_k[:, None] & mask_r[None, :], other=0.0)
            acc = tl.dot(x.to(DOT_DTYPE), a.to(DOT_DTYPE), acc, input_precision=PRECISION)
        acc = acc * scale
        y = y_ptr + pid_k * stride_yk + s * stride_ys + rows[:, None] * stride_yt + offs_r[None, :]
        tl.store(y, acc, mask=mask_m[:, None] & mask_r[None, :])


def _expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    order_ptr,
    tiles_ptr,
    num_tiles,
    rank,
    slice_ends,
    stride_yk,
    stride_ys,
    stride_yt,
    stride_bl,
    stride_bn,
    stride_br,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[t, n] += (y[0, s, t] + ... + y[SPLIT_K - 1, s, t]) @ B[slot, n]^T for the tokens t
    of one tile and slice s's columns n.

    y: [SPLIT_K, S, T, R] fp32 partials, added in split order (SPLIT_K = 1: y itself).
    Grid (tile, slice s, column block): a program owns BLOCK_N of the slice's
    columns; the blocks past a narrower slice's last column, and empty tiles, do
    nothing. Only the rows of the tile's tokens are read.
    """
    s = tl.program_id(1)
    pid_n = tl.program_id(2)
    # Columns [n_lo, n_hi) of out (and rows of B) belong to slice s.
    n_lo = 0
    n_hi = slice_ends[0]
    for i in tl.static_range(1, NUM_SLICES):
        n_lo = tl.where(s == i, slice_ends[i - 1], n_lo)
        n_hi = tl.where(s == i, slice_ends[i], n_hi)
    offs_n = n_lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    start, end = _bounds(tiles_ptr, num_tiles)
    if (n_lo + pid_n * BLOCK_N < n_hi) & (start < end):
        slot, rows, mask_m = _rows(tiles_ptr, order_ptr, num_tiles, start, end, BLOCK_M)
        mask_n = offs_n < n_hi
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        y_rows = y_ptr + s * stride_ys + rows[:, None] * stride_yt + offs_r[None, :]
        mask_y = mask_m[:, None] & mask_r[None, :]
        y = tl.load(y_rows, mask=mask_y, other=0.0)
        for k in tl.static_range(1, SPLIT_K):  # a fixed order: the same bits every run
            y += tl.load(y_rows + k * stride_yk, mask=mask_y, other=0.0)
        b = tl.load(
            b_ptr + slot * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        )
        delta = tl.dot(y, b.to(tl.float32), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        out = out_ptr + rows[:, None] * stride_ot + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        acc = tl.load(out, mask=mask, other=0.0).to(tl.float32) + delta
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


shrink_kernel = jit.Kernel(_shrink_kernel)
expand_kernel = jit.Kernel(_expand_kernel)


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    slots,
    scale: float = 1.0,
    out=None,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton ``reference.lora_shrink``: same arguments, shapes and result.

    ``config``: launch configuration (module docstring); None: tuned, else heuristics.
    """
    lora_checks.check_shrink(x, lora_a)
    num_slices, num_slots, rank, hidden = lora_a.shape
    mapping = as_mapping(slots, x.device)
    lora_checks.check_mapping(mapping, x, num_slots)
    if out is None:
        out = x.new_empty(num_slices, x.shape[0], rank, dtype=torch.float32)
    lora_checks.check_out(out, (num_slices, x.shape[0], rank), x.device)
    out.zero_()
    if mapping.num_tiles == 0:
        return out
    shape = dict(num_tokens=x.shape[0], rank=rank, num_slices=num_slices, hidden=hidden)
    cfg = resolve("lora_shrink", config, x.device, **shape)
    block_k = _block_k(cfg, hidden)
    split_k = _split_k(cfg, mapping.num_tiles * num_slices, hidden, block_k, x.device)
    # split: one zeroed partial per split (rows of tokens in no tile stay 0), added below
    dest = out if split_k == 1 else out.new_zeros(split_k, *out.shape)
    _launch_shrink(x, lora_a, dest, mapping, scale, block_k, split_k, cfg)
    if split_k > 1:
        torch.sum(dest, dim=0, out=out)  # a fixed order: the same bits every run
    return out


def lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    slots,
    out: torch.Tensor,
    slice_widths=None,
    config: dict | None = None,
) -> None:
    """Triton ``reference.lora_expand``: same arguments and in-place update.

    ``config``: launch configuration (module docstring); None: tuned, else heuristics.
    """
    lora_checks.check_expand(y, lora_b, out)
    widths = lora_checks.widths_of(y.shape[0], lora_b, slice_widths)
    mapping = as_mapping(slots, out.device)
    lora_checks.check_mapping(mapping, out, lora_b.shape[0])
    if mapping.num_tiles == 0:
        return
    shape = dict(num_tokens=out.shape[0], rank=y.shape[2], num_slices=len(widths), widths=widths)
    cfg = resolve("lora_expand", config, out.device, **shape)
    _launch_expand(y[None], lora_b, out, mapping, widths, cfg)


def lora_linear(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    mapping: LoRAMapping,
    out: torch.Tensor,
    slice_widths=None,
    config: dict | None = None,
) -> None:
    """Semantics: out[t, o_s : o_s + n_s] += x[t] @ A[s, slot[t]]^T @ B[slot[t], o_s : o_s + n_s]^T,
    i.e. ``lora_expand(lora_shrink(x, lora_a, mapping), lora_b, mapping, out, slice_widths)``
    in two launches (module docstring), the shrink's partials added inside the expand.

    Args:
        x: [T, H_in]; lora_a: [S, L, R, H_in]; lora_b: [L, N, R]; out: [T, N], updated
            in place (rows of tokens with slot -1 untouched); slice_widths: S widths
            summing to N, None for one slice.
        config: launch configuration (module docstring); None: tuned, else heuristics.
    """
    lora_checks.check_shrink(x, lora_a)
    num_slices, num_slots, rank, hidden = lora_a.shape
    lora_checks.check_b_out(lora_b, out, x.shape[0], rank)
    widths = lora_checks.widths_of(num_slices, lora_b, slice_widths)
    lora_checks.check_mapping(mapping, x, num_slots)
    jit.check_device(x.device, out=out, lora_b=lora_b, mapping=mapping.order)
    if mapping.num_tiles == 0:
        return
    shape = dict(num_tokens=x.shape[0], rank=rank, num_slices=num_slices, hidden=hidden)
    cfg = resolve("lora_linear", config, x.device, widths=widths, **shape)
    block_k = _block_k(cfg, hidden)
    split_k = _split_k(cfg, mapping.work_tiles * num_slices, hidden, block_k, x.device)
    partials = x.new_empty(split_k, num_slices, x.shape[0], rank, dtype=torch.float32)
    _launch_shrink(x, lora_a, partials, mapping, 1.0, block_k, split_k, cfg)
    _launch_expand(partials, lora_b, out, mapping, widths, cfg)


def split_k_factor(num_programs: int, num_k_blocks: int, device: torch.device) -> int:
    """Splits the reduction until the programs roughly fill the device."""
    target = jit.num_sms(device) if device.type == "cuda" else 4
    split = 1
    while split < MAX_SPLIT_K and num_programs * split * 2 <= target and split * 2 <= num_k_blocks:
        split *= 2
    return split


def _block_k(cfg: dict, hidden: int) -> int:
    return cfg.get("BLOCK_K") or min(128, jit.next_pow2(hidden))


def _split_k(cfg: dict, num_programs: int, hidden: int, block_k: int, device) -> int:
    split = cfg.get("SPLIT_K")
    if split is None:
        return split_k_factor(num_programs, triton.cdiv(hidden, block_k), device)
    return split


def _launch_shrink(x, lora_a, dest, mapping, scale, block_k, split_k, cfg) -> None:
    """Shrink into ``dest``: [S, T, R] with no split, else [split_k, S, T, R]."""
    num_slices, _, rank, hidden = lora_a.shape
    shrink_kernel[(mapping.num_tiles, num_slices, split_k)](
        x,
        lora_a,
        dest,
        mapping.order,
        mapping.tiles,
        mapping.num_tiles,
        hidden,
        rank,
        float(scale),
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        dest.stride(0) if dest.dim() == 4 else 0,
        dest.stride(-3),
        dest.stride(-2),
        BLOCK_M=mapping.block_m,
        BLOCK_R=jit.next_pow2(rank),
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        DOT_DTYPE=jit.dot_dtype(x.dtype),
        PRECISION=jit.dot_precision(x.dtype),
        **launch_options(cfg),
    )


def _launch_expand(partials, lora_b, out, mapping, widths, cfg) -> None:
    """Expand from ``partials`` [SPLIT_K, S, T, R], summed in the kernel."""
    split_k, _, _, rank = partials.shape
    ends = tuple(sum(widths[: s + 1]) for s in range(len(widths)))
    block_n = cfg.get("BLOCK_N") or min(128, jit.next_pow2(max(widths), 32))
    grid = (mapping.num_tiles, len(widths), triton.cdiv(max(widths), block_n))
    expand_kernel[grid](
        partials,
        lora_b,
        out,
        mapping.order,
        mapping.tiles,
        mapping.num_tiles,
        rank,
        ends,
        partials.stride(0),
        partials.stride(1),
        partials.stride(2),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        out.stride(0),
        BLOCK_M=mapping.block_m,
        BLOCK_N=block_n,
        BLOCK_R=jit.next_pow2(rank),
        NUM_SLICES=len(widths),
        SPLIT_K=split_k,
        PRECISION=jit.dot_precision(out.dtype),
        **launch_options(cfg),
    )
