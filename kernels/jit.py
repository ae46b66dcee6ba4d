"""Triton kernels that choose compiled or interpreted form at launch time.

Triton decides between compiling a kernel and interpreting it when
``@triton.jit`` decorates the function: it reads ``TRITON_INTERPRET`` through
``triton.knobs.runtime.interpret`` once, at decoration (triton 3.x,
``triton/runtime/jit.py``). A module decorated at import time would therefore
freeze the mode of the whole process: importing it while the kernel tests
have ``TRITON_INTERPRET=1`` set would make every later CUDA call interpret,
and importing it first without the variable would make the interpreter tests
try to compile for a GPU that is not there.

``Kernel`` keeps the plain Python function and builds its jitted form per
launch mode, the first time that mode is launched: ``triton.jit`` runs at
launch time, so the knob is read then. Together with the dispatch in
``lorapool.kernels`` (which also reads ``TRITON_INTERPRET`` at call time), the
kernel tests set the variable for their own duration only (a pytest fixture)
and every other test in the same process keeps the CPU reference.

Jitted functions that a kernel calls (``tl.max``, ``tl.sum``, ``tl.zeros`` of
triton.language, the kernel module's own ``@triton.jit`` helpers) are frozen
at import, normally in compiled form, which the interpreter cannot call. For
an interpreted launch ``Kernel`` swaps in interpreted forms of them and puts
the originals back afterwards (``_interpretable_helpers``). A process that
imports triton with ``TRITON_INTERPRET=1`` already set interprets throughout.
"""

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from inspect import ismodule

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Kernel:
    """A Triton kernel launched as ``kernel[grid](*args)``, compiled or interpreted."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._forms: dict[bool, object] = {}

    def __getitem__(self, grid):
        interpret = bool(triton.knobs.runtime.interpret)
        form = self._forms.get(interpret)
        if form is None:
            form = self._forms[interpret] = triton.jit(self.fn)
        if not interpret:
            return form[grid]

        def launch(*args, **kwargs):
            with _interpretable_helpers(sys.modules[self.fn.__module__]):
                return form[grid](*args, **kwargs)

        return launch


@contextmanager
def _interpretable_helpers(kernel_module) -> Iterator[None]:
    """Interpreted forms of the jitted functions a kernel can reach, for one launch.

    The interpreter also leaves things behind that break later compilation:
    it copies its own globals into the namespace of each function it runs (as
    if ``from __future__ import annotations`` were there), and a call from one
    jitted function to another patches ``triton.language`` with interpreter
    builtins that are never put back. Everything such a launch can touch is
    saved before and restored after it.
    """
    from triton.runtime import interpreter

    spaces = (tl, tl.standard, tl.random, kernel_module)
    touched = (
        *spaces,
        tl.core,
        tl.math,
        tl.core.tensor,
        tl.core.dtype,
        tl.core.condition,
        tl.core.tensor_descriptor_base,
    )
    saved = [(obj, dict(vars(obj))) for obj in touched]
    forms: dict[int, interpreter.InterpretedFunction] = {}
    for space in spaces:
        for name, f in list(vars(space).items()):
            if isinstance(f, JITFunction):
                form = forms.setdefault(id(f), interpreter.InterpretedFunction(f.fn))
                setattr(space, name, form)
        for name, value in vars(interpreter).items():
            if name not in vars(space):  # what the interpreter would add, now and gone after
                setattr(space, name, value)
    try:
        yield
    finally:
        for obj, attrs in saved:
            _restore(obj, attrs)


def _restore(obj, attrs: dict) -> None:
    current = vars(obj)
    for name in [n for n, v in current.items() if n not in attrs and not ismodule(v)]:
        delattr(obj, name)  # submodules imported meanwhile stay
    for name, value in attrs.items():
        if current.get(name) is not value:
            setattr(obj, name, value)


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
    if dtype == torch.bfloat16 and triton.knobs.runtime.interpret:
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
