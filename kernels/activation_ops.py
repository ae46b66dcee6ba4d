"""Triton SiLU-and-multiply: the activation of a gated (SwiGLU) MLP."""

import torch
import triton
import triton.language as tl

from lorapool.kernels import jit

BLOCK_I = 1024  # columns per program: one program covers a small model's whole row


def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_xt, stride_ot, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # rounded as F.silu's result
    tl.store(out_ptr + t * stride_ot + offs, (silu * up).to(dtype), mask=mask)


silu_and_mul_kernel = jit.Kernel(_silu_and_mul_kernel)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton ``reference.silu_and_mul``: [T, 2I] -> [T, I]."""
    jit.check_shape("gate_up", gate_up, (None, None))
    jit.check_dtype("gate_up", gate_up, jit.FLOAT_DTYPES)
    jit.check_last_contiguous(gate_up=gate_up)
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even width; got {width}")
    inter = width // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(BLOCK_I, jit.next_pow2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    silu_and_mul_kernel[grid](gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
