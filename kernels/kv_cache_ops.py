"""Triton kernel that writes new keys and values into the paged KV cache."""

import torch
import triton.language as tl

from lorapool.kernels import jit

INDEX_DTYPES = (torch.int32, torch.int64)


def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_heads,
    head_size,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # a negative slot (padding) is skipped, never written out of bounds
        blk = slot // block_size
        off = slot % block_size
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        mask = (offs_h < num_heads) & (offs_d < head_size)
        k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
        k_dst = k_cache_ptr + blk * stride_cb + off * stride_cs + offs_h * stride_ch + offs_d
        v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + offs_h * stride_vch + offs_d
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


write_kv_kernel = jit.Kernel(_write_kv_kernel)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Triton ``reference.write_kv_cache``; a negative slot is skipped."""
    check_cache(key_cache, value_cache)
    num_blocks, block_size, num_heads, head_size = key_cache.shape
    jit.check_shape("key", key, (None, num_heads, head_size))
    jit.check_shape("value", value, tuple(key.shape))
    jit.check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    jit.check_dtype("key", key, jit.FLOAT_DTYPES)
    jit.check_dtype("value", value, jit.FLOAT_DTYPES)
    jit.check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    jit.check_device(key_cache.device, key=key, value=value, slot_mapping=slot_mapping)
    jit.check_last_contiguous(key=key, value=value)
    if key.shape[0] == 0:
        return
    write_kv_kernel[(key.shape[0],)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_heads,
        head_size,
        block_size,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        BLOCK_H=jit.next_pow2(num_heads, 1),
        BLOCK_D=jit.next_pow2(head_size, 1),
    )


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    jit.check_shape("key_cache", key_cache, (None, None, None, None))
    jit.check_shape("value_cache", value_cache, tuple(key_cache.shape))
    jit.check_dtype("key_cache", key_cache, jit.FLOAT_DTYPES)
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache has dtype {value_cache.dtype}, key_cache {key_cache.dtype}")
    jit.check_device(key_cache.device, value_cache=value_cache)
    jit.check_last_contiguous(key_cache=key_cache, value_cache=value_cache)
    if key_cache.shape[1] & (key_cache.shape[1] - 1):
        raise ValueError(f"block size must be a power of two; got {key_cache.shape[1]}")
