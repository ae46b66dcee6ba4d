"""Argument checks of the LoRA ops (``lora_ops``): shapes, dtypes, devices, strides and
slice widths, each refusal a ValueError that names the argument."""

import torch

from lorapool.kernels import jit
from lorapool.kernels.lora_mapping import LoRAMapping
from lorapool.kernels.reference import check_slice_widths

MAX_SLICES = 3


def widths_of(num_slices: int, lora_b: torch.Tensor, slice_widths) -> list[int]:
    widths = check_slice_widths(num_slices, lora_b.shape[1], slice_widths)
    if len(widths) > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} slices are supported; got {len(widths)}")
    return widths


def check_shrink(x: torch.Tensor, lora_a: torch.Tensor) -> None:
    jit.check_shape("x", x, (None, None))
    jit.check_shape("lora_a", lora_a, (None, None, None, x.shape[1]))
    jit.check_dtype("x", x, jit.FLOAT_DTYPES)
    if lora_a.dtype != x.dtype:
        raise ValueError(f"lora_a has dtype {lora_a.dtype} but x has {x.dtype}")
    jit.check_device(x.device, lora_a=lora_a)
    jit.check_last_contiguous(x=x, lora_a=lora_a)


def check_expand(y: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor) -> None:
    jit.check_shape("y", y, (None, out.shape[0] if out.dim() == 2 else None, None))
    jit.check_dtype("y", y, (torch.float32,))
    check_b_out(lora_b, out, y.shape[1], y.shape[2])
    jit.check_device(out.device, y=y, lora_b=lora_b)
    jit.check_last_contiguous(y=y)


def check_b_out(lora_b: torch.Tensor, out: torch.Tensor, num_tokens: int, rank: int) -> None:
    jit.check_shape("lora_b", lora_b, (None, None, rank))
    jit.check_shape("out", out, (num_tokens, lora_b.shape[1]))
    jit.check_dtype("lora_b", lora_b, jit.FLOAT_DTYPES)
    jit.check_dtype("out", out, jit.FLOAT_DTYPES)
    jit.check_last_contiguous(out=out)  # lora_b: any strides


def check_out(out: torch.Tensor, shape, device: torch.device) -> None:
    jit.check_shape("out", out, shape)
    jit.check_dtype("out", out, (torch.float32,))
    jit.check_device(device, out=out)
    jit.check_last_contiguous(out=out)


def check_mapping(mapping: LoRAMapping, t: torch.Tensor, num_slots: int) -> None:
    mapping.check_fits(t.shape[0], num_slots)
    jit.check_device(t.device, mapping=mapping.order)
