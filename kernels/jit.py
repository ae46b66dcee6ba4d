"""Triton kernels, compiled or interpreted as the whole process is: helpers for the kernel modules.

Triton decides between compiling a kernel and interpreting it when
``@triton.jit`` decorates the function, reading ``TRITON_INTERPRET`` then
(``triton.knobs.runtime.interpret``); its own jitted helpers (``tl.max``,
``tl.sum``, ...) are decorated when triton is imported. So the mode belongs
to the process: one started with ``TRITON_INTERPRET=1`` interprets every
kernel on the CPU (the kernel tests run in such a process of their own), any
other compiles for the GPU. Nothing here switches it afterwards or touches
Triton's internals; ``Kernel`` refuses a launch in the other mode, with an error
that says how to choose it, instead of failing somewhere inside Triton.
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (now, as the environment says)."""
    return bool(triton.knobs.runtime.interpret)


class Kernel:
    """A Triton kernel launched as ``kernel[grid](*args)``; jitted once, in the process's mode."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.interpreted = interpreting()
        self.jitted = triton.jit(fn)

    def __getitem__(self, grid):
        if interpreting() != self.interpreted:
            mode = "interpreted" if self.interpreted else "compiled"
            raise RuntimeError(
                f"Triton kernel {self.fn.__name__} was jitted {mode} when its module was imported, "
                "and TRITON_INTERPRET has changed since. Triton's mode is chosen per process: "
                "set TRITON_INTERPRET=1 before the process starts to run the kernels on the CPU."
            )
        return self.jitted[grid]


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 products for fp32, tf32 otherwise.

    tf32 holds every fp16 and bf16 value exactly, so an fp32 operand that came
    from a half-precision tensor loses nothing; only fp32 data needs "ieee".
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_dtype(dtype: torch.dtype):
    """The dtype ``tl.dot`` operands are cast to (a no-op on GPUs).

    Triton's interpreter stores bfloat16 as uint16 and multiplies those
    integers in ``tl.dot``, so under the interpreter bf16 operands go in as
    float32 (exact) instead.
    """
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(dtype, tl.float32)


def next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(n))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must have dtype {names}; got {t.dtype}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Checks rank and every dimension that is not None."""
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}; got {list(t.shape)}")


def check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_last_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dimension; strides are {t.stride()}"
            )
