"""Triton RMSNorm, alone or fused with the residual add before it."""

import torch
import triton.language as tl

from lorapool.kernels import jit


def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    hidden,
    eps,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_ot,
    stride_oh,
    ADD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < hidden
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # residual += x, rounded to the residual's dtype as the unfused add is
        res = res_ptr + t * stride_rt + offs
        total = (x + tl.load(res, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res, total, mask=mask)
        x = total.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    # normalised in fp32, rounded to the dtype (a no-op in fp32), then scaled
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs, out, mask=mask)


rms_norm_kernel = jit.Kernel(_rms_norm_kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton ``reference.rms_norm`` of x: [T, D] or [T, H, D] (e.g. per-head q/k norms)."""
    _check_norm(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3, out3 = _as_3d(x), _as_3d(out)
    _launch(x3, x3, weight, out3, eps, add=False)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Triton ``reference.fused_add_rms_norm``: residual += x in place; returns its norm."""
    _check_norm(residual, weight)
    jit.check_shape("residual", residual, (None, weight.shape[0]))
    jit.check_shape("x", x, tuple(residual.shape))
    jit.check_dtype("x", x, (residual.dtype,))
    jit.check_device(residual.device, x=x)
    jit.check_last_contiguous(x=x)
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    _launch(_as_3d(x), _as_3d(residual), weight, _as_3d(out), eps, add=True)
    return out


def _launch(x, residual, weight, out, eps: float, add: bool) -> None:
    num_tokens, num_heads, hidden = x.shape
    if num_tokens == 0:
        return
    rms_norm_kernel[(num_tokens, num_heads)](
        x,
        residual,
        weight,
        out,
        hidden,
        float(eps),
        x.stride(0),
        x.stride(1),
        residual.stride(0),
        out.stride(0),
        out.stride(1),
        ADD=add,
        BLOCK_D=jit.next_pow2(hidden, 1),
    )


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.unsqueeze(1)


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() not in (2, 3):
        raise ValueError(f"x must have shape [T, D] or [T, H, D]; got {list(x.shape)}")
    jit.check_shape("weight", weight, (x.shape[-1],))
    jit.check_dtype("x", x, jit.FLOAT_DTYPES)
    jit.check_dtype("weight", weight, (x.dtype,))
    jit.check_device(x.device, weight=weight)
    jit.check_last_contiguous(x=x, weight=weight)
