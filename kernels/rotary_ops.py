"""Triton RoPE fused with the paged KV-cache write (and, for Qwen3, the q/k norms)."""

import torch
import triton
import triton.language as tl

from lorapool.kernels import jit
from lorapool.kernels.kv_cache_ops import INDEX_DTYPES, check_cache


def _rotary_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    num_q_heads,
    num_kv_heads,
    half,
    block_size,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_sin,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    QK_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)[None, :]  # one half of a head vector
    in_half = offs_r < half
    cos = tl.load(cos_ptr + pos * stride_cos + offs_r, mask=in_half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + offs_r, mask=in_half, other=0.0).to(tl.float32)
    offs_hq = tl.arange(0, BLOCK_HQ)[:, None]
    mask_q = (offs_hq < num_q_heads) & in_half
    src_q = q_ptr + t * stride_qt + offs_hq * stride_qh + offs_r
    q1, q2 = _rotate(src_q, half, offs_r, q_norm_ptr, eps, cos, sin, mask_q, q_out_ptr, QK_NORM)
    dst_q = q_out_ptr + t * stride_ot + offs_hq * stride_oh + offs_r
    tl.store(dst_q, q1, mask=mask_q)
    tl.store(dst_q + half, q2, mask=mask_q)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # a negative slot (padding) is skipped, never written out of bounds
        offs_hk = tl.arange(0, BLOCK_HKV)[:, None]
        mask_k = (offs_hk < num_kv_heads) & in_half
        src_k = k_ptr + t * stride_kt + offs_hk * stride_kh + offs_r
        k1, k2 = _rotate(src_k, half, offs_r, k_norm_ptr, eps, cos, sin, mask_k, q_out_ptr, QK_NORM)
        blk, off = slot // block_size, slot % block_size
        dst_k = k_cache_ptr + blk * stride_cb + off * stride_cs + offs_hk * stride_ch + offs_r
        tl.store(dst_k, k1.to(k_cache_ptr.dtype.element_ty), mask=mask_k)
        tl.store(dst_k + half, k2.to(k_cache_ptr.dtype.element_ty), mask=mask_k)
        src_v = v_ptr + t * stride_vt + offs_hk * stride_vh + offs_r
        dst_v = v_cache_ptr + blk * stride_vcb + off * stride_vcs + offs_hk * stride_vch + offs_r
        v_dtype = v_cache_ptr.dtype.element_ty
        tl.store(dst_v, tl.load(src_v, mask=mask_k).to(v_dtype), mask=mask_k)
        tl.store(dst_v + half, tl.load(src_v + half, mask=mask_k).to(v_dtype), mask=mask_k)


def _rotate_fn(src, half, offs_r, norm_ptr, eps, cos, sin, mask, like_ptr, QK_NORM: tl.constexpr):
    """(x1 * cos - x2 * sin, x2 * cos + x1 * sin) of the head vectors at src, each product
    and sum rounded to the model dtype as the unfused torch ops round them."""
    dtype = like_ptr.dtype.element_ty
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # per-head RMSNorm: fp32, rounded, then scaled (reference.rms_norm)
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half)
        inv_rms = (1.0 / tl.sqrt(var + eps))[:, None]
        w1 = tl.load(norm_ptr + offs_r, mask=offs_r < half, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + half + offs_r, mask=offs_r < half, other=0.0).to(tl.float32)
        x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    a, b = (x1 * cos).to(dtype).to(tl.float32), (x2 * sin).to(dtype).to(tl.float32)
    c, d = (x2 * cos).to(dtype).to(tl.float32), (x1 * sin).to(dtype).to(tl.float32)
    return (a - b).to(dtype), (c + d).to(dtype)


_rotate = triton.jit(_rotate_fn)  # a device function, jitted in the process's mode as Kernel is
rotary_kv_kernel = jit.Kernel(_rotary_kv_kernel)


def rotary_write_kv(
    query,
    key,
    value,
    cos_table,
    sin_table,
    positions,
    key_cache,
    value_cache,
    slot_mapping,
    qk_norm=None,
) -> torch.Tensor:
    """Triton ``reference.rotary_write_kv``: one launch; returns the rotated queries."""
    _check_rotary(query, key, value, cos_table, sin_table, positions, key_cache, slot_mapping)
    check_cache(key_cache, value_cache)
    num_tokens, num_q_heads, head_size = query.shape
    num_kv_heads, block_size, half = key.shape[1], key_cache.shape[1], head_size // 2
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return q_out
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (query, query, 0.0)
    if qk_norm is not None:
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            jit.check_shape(name, w, (head_size,))
            jit.check_dtype(name, w, (query.dtype,))
            jit.check_last_contiguous(**{name: w})
    rotary_kv_kernel[(num_tokens,)](
        query,
        key,
        value,
        q_out,
        key_cache,
        value_cache,
        cos_table,
        sin_table,
        positions,
        slot_mapping,
        q_norm,
        k_norm,
        float(eps),
        num_q_heads,
        num_kv_heads,
        half,
        block_size,
        *query.stride()[:2],
        *key.stride()[:2],
        *value.stride()[:2],
        *q_out.stride()[:2],
        cos_table.stride(0),
        sin_table.stride(0),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        QK_NORM=qk_norm is not None,
        BLOCK_HQ=jit.next_pow2(num_q_heads, 1),
        BLOCK_HKV=jit.next_pow2(num_kv_heads, 1),
        BLOCK_R=jit.next_pow2(half, 1),
    )
    return q_out


def _check_rotary(query, key, value, cos_table, sin_table, positions, key_cache, slot_mapping):
    num_kv_heads, head_size = key_cache.shape[2:]
    if head_size % 2:
        raise ValueError(f"rotary embeddings need an even head size; got {head_size}")
    jit.check_shape("query", query, (None, None, head_size))
    jit.check_shape("key", key, (query.shape[0], num_kv_heads, head_size))
    jit.check_shape("value", value, tuple(key.shape))
    jit.check_shape("cos_table", cos_table, (None, head_size // 2))
    jit.check_shape("sin_table", sin_table, tuple(cos_table.shape))
    jit.check_shape("positions", positions, (query.shape[0],))
    jit.check_shape("slot_mapping", slot_mapping, (query.shape[0],))
    for name, t in (("key", key), ("value", value), ("cos_table", cos_table)):
        jit.check_dtype(name, t, (query.dtype,))
    jit.check_dtype("sin_table", sin_table, (query.dtype,))
    jit.check_dtype("positions", positions, INDEX_DTYPES)
    jit.check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    jit.check_device(
        key_cache.device,
        query=query,
        key=key,
        value=value,
        cos_table=cos_table,
        sin_table=sin_table,
        positions=positions,
        slot_mapping=slot_mapping,
    )
    jit.check_last_contiguous(
        query=query, key=key, value=value, cos_table=cos_table, sin_table=sin_table
    )
    if positions.stride(0) != 1 or slot_mapping.stride(0) != 1:
        raise ValueError("positions and slot_mapping must be contiguous")
