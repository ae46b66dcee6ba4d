"""Small building blocks: packed linear projections and RMSNorm.

Parameters are allocated uninitialised (``torch.empty``): every value is
overwritten by the checkpoint, so random initialisation would be wasted time.
"""

import torch
import torch.nn.functional as F
from torch import nn

from lorapool import kernels

# On the CPU path, a product of at most this many tokens (a decode step) is
# computed as (W @ x^T)^T, whose result is a column-major view (the Triton kernels,
# on CUDA or interpreted, take row-major tensors only): MKL streams the weight
# through that form faster than through x @ W^T; from about 512 tokens on,
# x @ W^T is as fast or faster (benchmarks/RESULTS.md, "CPU engine").
SKINNY_TOKENS = 256


class PackedLinear(nn.Module):
    """y = x @ W^T (+ b), where W stacks several projections along the output axis.

    ``output_sizes`` lists the width of each packed slice in order (e.g. the
    q, k and v widths of a fused qkv projection) so that a LoRA layer can add
    one update per slice; a plain projection has a single slice.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.weight = nn.Parameter(
            torch.empty(self.out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.bias = None
        self.lora = None  # a LoRALayer when the engine serves adapters on this projection
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.out_features, dtype=dtype), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= SKINNY_TOKENS and not kernels.use_triton(x):
            if self.bias is None:
                out = torch.mm(self.weight, x.t()).t()
            else:
                out = torch.addmm(self.bias.unsqueeze(1), self.weight, x.t()).t()
        else:
            out = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            out = self.lora.apply(x, out)
        return out

    def slice_offsets(self, index: int) -> tuple[int, int]:
        """(start, end) rows of packed slice ``index`` in the weight."""
        start = sum(self.output_sizes[:index])
        return start, start + self.output_sizes[index]

    def load_slice(self, param_name: str, index: int, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor into slice ``index`` of ``weight`` or ``bias``."""
        start, end = self.slice_offsets(index)
        target = getattr(self, param_name)
        if target is None:
            raise ValueError(f"checkpoint has a {param_name} this projection does not use")
        _copy_checked(target.data[start:end], tensor)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, normalised in fp32 over the last axis."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Half precision: normalise in fp32, round, then scale (as transformers does).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def _copy_checked(target: torch.Tensor, tensor: torch.Tensor) -> None:
    if target.shape != tensor.shape:
        raise ValueError(
            f"shape mismatch: expected {tuple(target.shape)}, got {tuple(tensor.shape)}"
        )
    target.copy_(tensor)


def load_param(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter (casting dtype, moving device)."""
    _copy_checked(param.data, tensor)
