"""Triton paged attention: causal attention over the paged KV cache.

``paged_attention`` is one kernel for decode, prefill and prefill on top of a
cached context (chunked prefill, prefix caching): a decode token is a query
block of one token. A program owns a block of BLOCK_Q query tokens of one
sequence and one KV head; its rows are the BLOCK_Q x GROUP query heads that
share that KV head (GQA), so each K/V tile read from the cache serves all of
them, and the rows fill the MMA tile even in decode. The program walks the
sequence's block table up to its last query's position, BLOCK_N positions
(one or more cache blocks) at a time, with an online softmax in fp32
(flash-attention style), masking causally by absolute position. Programs
find their sequence by binary search over ``query_start_loc``, so the grid
comes from shapes alone: no device sync. Small decode batches also split
each context over several programs (flash-decoding) and combine the parts.

A program reads only positions inside its sequence's context (loads past it
are masked, so never read), and selects masked scores and probabilities away
rather than multiplying them by zero: whatever other slots hold, a freed
block's NaN or Inf included, cannot reach the result.

Launch configuration: today's heuristics (``_heuristic``) unless the device has
a tuned entry for the call's shape (``kernels/tuned.py``: ``lookup(device,
"paged_attention", config_key(...))``, written by the GPU kit's sweep into
``kernels/configs/<device>.json``), or the caller passes ``config=`` (the sweep
does; ``config={}`` is the heuristics alone). A config is a dict of any of
``block_n``, ``num_splits``, ``num_warps``, ``num_stages``; a key it lacks keeps
the heuristic's value.
"""

import math

import torch
import triton
import triton.language as tl

from lorapool.kernels import jit
from lorapool.kernels.attention_configs import (  # noqa: F401 - the sweep's names here too
    CONFIG_KEYS,
    MAX_SPLITS,
    OP,
    candidates,
    checked,
    config_key,
    heuristic,
    kv_splits,
    tuned_config,
)
from lorapool.kernels.kv_cache_ops import INDEX_DTYPES as _INDEX_DTYPES
from lorapool.kernels.kv_cache_ops import check_cache


@triton.jit
def _sequence_of(pid, qsl_ptr, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence b owning query block pid: blocks [first(b), first(b + 1)) are b's."""
    lo = pid * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid)
        if BLOCK_Q > 1:
            first = first // BLOCK_Q + mid
        lo = tl.where(first <= pid, mid, lo)
        hi = tl.where(first <= pid, hi, mid)
    return lo


@triton.jit
def _kv_tile(head_ptr, blk, slot, stride_b, stride_s, offs_d, mask):
    """cache[blk, slot, head, :] for one KV head (``head_ptr``): a [BLOCK_N, BLOCK_D] tile."""
    off = blk * stride_b + slot * stride_s
    return tl.load(head_ptr + off[:, None] + offs_d[None, :], mask=mask, other=0.0)


def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    num_seqs,
    num_tokens,
    num_heads,
    head_size,
    split_size,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b = _sequence_of(pid, qsl_ptr, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    first_b = q_start
    if BLOCK_Q > 1:
        first_b = q_start // BLOCK_Q + b
    q_block = (pid - first_b) * BLOCK_Q
    if q_block < q_len:
        ctx_len = tl.load(seq_lens_ptr + b)
        rows = tl.arange(0, BLOCK_M)
        q_idx = q_block + rows // GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        pos = ctx_len - q_len + q_idx  # absolute position of each row's query
        heads = kv_head * GROUP + rows % GROUP
        tokens = (q_start + q_idx).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_size
        mask = row_ok[:, None] & mask_d[None, :]
        q = tl.load(
            q_ptr + (tokens * stride_qt + heads * stride_qh)[:, None] + offs_d[None, :],
            mask=mask,
            other=0.0,
        )
        kv_lo = split * split_size
        kv_hi = tl.minimum(
            ctx_len - q_len + tl.minimum(q_block + BLOCK_Q, q_len), kv_lo + split_size
        )
        # online softmax of the rows over cache positions [kv_lo, kv_hi)
        table = block_tables_ptr + b.to(tl.int64) * stride_bt
        k_head = k_cache_ptr + kv_head * stride_kh
        v_head = v_cache_ptr + kv_head * stride_vh
        m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for start in range(kv_lo, kv_hi, BLOCK_N):
            kv_pos = start + tl.arange(0, BLOCK_N)  # may span several cache blocks
            kv_ok = kv_pos < kv_hi
            blk = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
            kv_mask = kv_ok[:, None] & mask_d[None, :]
            k = _kv_tile(k_head, blk, kv_pos % BLOCK_SIZE, stride_kb, stride_ks, offs_d, kv_mask)
            v = _kv_tile(v_head, blk, kv_pos % BLOCK_SIZE, stride_vb, stride_vs, offs_d, kv_mask)
            s = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION)
            seen = kv_ok[None, :] & (kv_pos[None, :] <= pos[:, None])  # [BLOCK_M, BLOCK_N]
            s = tl.where(seen, s * qk_scale, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.where(seen, tl.exp2(s - m_new[:, None]), 0.0)  # exactly 0 where unseen
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if NUM_SPLITS == 1:
            out = out_ptr + (tokens * stride_ot + heads * stride_oh)[:, None] + offs_d[None, :]
            tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
        else:  # partial results [NUM_SPLITS, T, H, D + 2]: acc, then max and sum
            part = part_ptr + ((split * num_tokens + tokens) * num_heads + heads) * (head_size + 2)
            tl.store(part[:, None] + offs_d[None, :], acc, mask=mask)
            tl.store(part + head_size, m_i, mask=row_ok)
            tl.store(part + head_size + 1, l_i, mask=row_ok)


def _combine_kernel(
    part_ptr,
    out_ptr,
    num_tokens,
    num_heads,
    head_size,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s over the splits s."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    part = part_ptr + ((offs_s * num_tokens + t) * num_heads + h) * (head_size + 2)
    m = tl.load(part + head_size, mask=mask_s, other=-1.0e30)
    l = tl.load(part + head_size + 1, mask=mask_s, other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    mask = mask_s[:, None] & (offs_d < head_size)[None, :]
    acc = tl.load(part[:, None] + offs_d[None, :], mask=mask, other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < head_size,
    )


attention_kernel = jit.Kernel(_attention_kernel)
combine_kernel = jit.Kernel(_combine_kernel)


def paged_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale: float,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton ``reference.paged_attention``: same arguments, shapes and result.

    ``config``: launch settings (``CONFIG_KEYS``) over the heuristics, instead of the
    tuned entry (None: the tuned entry, else the heuristics); the result is the same
    up to summation order.
    """
    _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_size = query.shape
    num_seqs, num_kv_heads, block_size = seq_lens.shape[0], key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_q, block_m = _query_blocking(num_tokens, num_seqs, group)
    num_q_blocks = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    max_context = block_tables.shape[1] * block_size
    launch = heuristic(query, block_q, num_q_blocks * num_kv_heads, max_context, block_size)
    key = config_key(
        num_tokens, num_seqs, num_heads, num_kv_heads, head_size, max_context, query.dtype
    )
    launch |= tuned_config(query.device, key) if config is None else checked(config)
    block_n = max(int(launch["block_n"]), block_size)
    num_splits = max(1, min(int(launch["num_splits"]), MAX_SPLITS)) if block_q == 1 else 1
    split_size = max_context  # one split: the whole context (as the heuristics had it)
    if num_splits > 1:
        split_size = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    options = {k: int(launch[k]) for k in ("num_warps", "num_stages") if launch.get(k)}
    part = query.new_empty(
        num_splits if num_splits > 1 else 0,
        num_tokens,
        num_heads,
        head_size + 2,
        dtype=torch.float32,
    )
    attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        part,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        num_tokens,
        num_heads,
        head_size,
        split_size,
        float(scale) * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_D=jit.next_pow2(head_size),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        DOT_DTYPE=jit.dot_dtype(query.dtype),
        PRECISION=jit.dot_precision(query.dtype),
        **options,
    )
    if num_splits > 1:
        combine_kernel[(num_tokens, num_heads)](
            part,
            out,
            num_tokens,
            num_heads,
            head_size,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            BLOCK_S=jit.next_pow2(num_splits, 2),
            BLOCK_D=jit.next_pow2(head_size),
        )
    return out


def _query_blocking(num_tokens: int, num_seqs: int, group: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): one query per program in decode, a tile of them in prefill."""
    if num_tokens <= num_seqs:
        return 1, jit.next_pow2(group)
    block_m = jit.next_pow2(group, 64)
    return block_m // group, block_m


def _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc):
    check_cache(key_cache, value_cache)
    num_kv_heads, head_size = key_cache.shape[2:]
    jit.check_shape("query", query, (None, None, head_size))
    if query.shape[1] % num_kv_heads:
        raise ValueError(
            f"{query.shape[1]} query heads are not a multiple of {num_kv_heads} KV heads"
        )
    jit.check_dtype("query", query, (key_cache.dtype,))
    jit.check_shape("seq_lens", seq_lens, (None,))
    jit.check_shape("block_tables", block_tables, (seq_lens.shape[0], None))
    jit.check_shape("query_start_loc", query_start_loc, (seq_lens.shape[0] + 1,))
    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        jit.check_dtype(name, t, _INDEX_DTYPES)
    jit.check_device(
        query.device,
        key_cache=key_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
    )
    jit.check_last_contiguous(query=query, block_tables=block_tables)
    if seq_lens.stride(0) != 1 or query_start_loc.stride(0) != 1:
        raise ValueError("seq_lens and query_start_loc must be contiguous")
