"""Kernel ops with device dispatch.

CUDA tensors go to the Triton kernels; CPU tensors to ``reference``, unless
``TRITON_INTERPRET=1`` is set, in which case the Triton kernels run on the CPU
under Triton's interpreter (used by the tests).

The dispatch reads the variable at every call, but Triton's own choice between
compiling and interpreting is made once per process (``kernels.jit``): a process
that is to run the kernels on the CPU must have the variable set when it starts.
The kernel tests run in such a process of their own (``make test`` starts it);
within it, a test that unsets the variable takes the reference path.
The Triton modules are imported on first use: a CPU-only install, where
triton may be missing, never imports them.

LoRA, per layer and (packed) projection with S slices, L adapter slots and
the largest rank R:

    lora_a: [S, L, R, H_in]   each slice's A, zero-padded to rank R
    lora_b: [L, N, R]         the slices' B concatenated along N, the columns
                              of ``out``, with each adapter's scaling folded in
    mapping = LoRAMapping.from_slots(slot_of_each_token, device)  # once a step
    y = lora_shrink(x, lora_a, mapping)                # [S, T, R] float32
    lora_expand(y, lora_b, mapping, out, slice_widths)  # out[T, N] += y @ B^T

or both at once, as the engine does: ``lora_linear(x, lora_a, lora_b, mapping,
out, slice_widths)``, which on the CPU runs the fused plan of ``lora_cpu``.

The layer ops (``rms_norm``, ``fused_add_rms_norm``, ``rotary_write_kv``,
``silu_and_mul``) are one Triton launch each where the Triton kernels run; their
references are the torch ops the model's unfused path runs, rounding included.
The model takes them with ``EngineArgs.fused_layer_kernels``.

May import: torch and triton only (the Triton modules lazily); never the engine.
"""

import os

import torch

from lorapool.kernels import lora_cpu, reference
from lorapool.kernels.attention_plan import AttentionPlan
from lorapool.kernels.lora_mapping import LoRAMapping

__all__ = [
    "AttentionPlan",
    "LoRAMapping",
    "fused_add_rms_norm",
    "lora_expand",
    "lora_linear",
    "lora_shrink",
    "paged_attention",
    "rms_norm",
    "rotary_write_kv",
    "silu_and_mul",
    "use_triton",
    "write_kv_cache",
]


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on tensor ``t`` run as Triton kernels."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """See ``reference.write_kv_cache``."""
    if use_triton(key):
        from lorapool.kernels import kv_cache_ops as impl
    else:
        impl = reference
    impl.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def rms_norm(x, weight, eps: float) -> torch.Tensor:
    """See ``reference.rms_norm``."""
    if use_triton(x):
        from lorapool.kernels import norm_ops as impl
    else:
        impl = reference
    return impl.rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps: float) -> torch.Tensor:
    """See ``reference.fused_add_rms_norm``: residual += x in place; returns its norm."""
    if use_triton(residual):
        from lorapool.kernels import norm_ops as impl
    else:
        impl = reference
    return impl.fused_add_rms_norm(x, residual, weight, eps)


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
    """See ``reference.rotary_write_kv``: returns the rotated queries."""
    if use_triton(query):
        from lorapool.kernels import rotary_ops as impl
    else:
        impl = reference
    args = (query, key, value, cos_table, sin_table, positions)
    return impl.rotary_write_kv(*args, key_cache, value_cache, slot_mapping, qk_norm)


def silu_and_mul(gate_up) -> torch.Tensor:
    """See ``reference.silu_and_mul``."""
    if use_triton(gate_up):
        from lorapool.kernels import activation_ops as impl
    else:
        impl = reference
    return impl.silu_and_mul(gate_up)


def paged_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """See ``reference.paged_attention``; the Triton kernel plans on the device, so it
    ignores ``plan``."""
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
    if use_triton(query):
        from lorapool.kernels import attention_ops

        return attention_ops.paged_attention(*args)
    return reference.paged_attention(*args, plan=plan)


def lora_shrink(x, lora_a, slots, scale: float = 1.0, out=None) -> torch.Tensor:
    """See ``reference.lora_shrink``. ``slots`` is best a ``LoRAMapping`` built once per step."""
    if use_triton(x):
        from lorapool.kernels import lora_ops as impl
    else:
        impl = reference
    return impl.lora_shrink(x, lora_a, slots, scale, out)


def lora_expand(y, lora_b, slots, out, slice_widths=None) -> None:
    """See ``reference.lora_expand``. ``slots`` is best a ``LoRAMapping`` built once per step."""
    if use_triton(out):
        from lorapool.kernels import lora_ops as impl
    else:
        impl = reference
    impl.lora_expand(y, lora_b, slots, out, slice_widths)


def lora_linear(
    x,
    lora_a,
    lora_b,
    mapping: LoRAMapping,
    out,
    slice_widths=None,
    live_work: bool = False,
    config: dict | None = None,
) -> None:
    """``lora_expand(lora_shrink(x, lora_a, mapping), lora_b, mapping, out, slice_widths)``.

    On CUDA (or under the interpreter) the Triton kernels: with ``live_work``,
    ``lora_ops.lora_linear``'s two launches (split-K partials added inside the
    expand, split-K sized by the live tiles; ``config`` is its launch
    configuration), else ``lora_shrink`` then ``lora_expand`` as before
    (``EngineArgs.lora_live_work``). On the CPU the fused path of ``lora_cpu``,
    planned once per step from the mapping; ``live_work`` and ``config`` do not apply.
    """
    if use_triton(x):
        from lorapool.kernels import lora_ops

        if live_work:
            lora_ops.lora_linear(x, lora_a, lora_b, mapping, out, slice_widths, config)
            return
        if config is not None:
            raise ValueError("config applies to the live-work path only (live_work=True)")
        y = lora_ops.lora_shrink(x, lora_a, mapping)
        lora_ops.lora_expand(y, lora_b, mapping, out, slice_widths)
        return
    _check_lora_linear(x, lora_a, lora_b, mapping, out)
    widths = [out.shape[1]] if slice_widths is None else [int(w) for w in slice_widths]
    if len(widths) != lora_a.shape[0] or sum(widths) != lora_b.shape[1] or min(widths) <= 0:
        raise ValueError(
            f"slice_widths {widths} must be {lora_a.shape[0]} positive widths "
            f"summing to lora_b's {lora_b.shape[1]} rows"
        )
    lora_cpu.lora_linear(x, lora_cpu.SlotWeights.of(lora_a, lora_b, widths), mapping.cpu_plan, out)


def _check_lora_linear(x, lora_a, lora_b, mapping: LoRAMapping, out) -> None:
    num_slices, num_slots, rank, hidden = lora_a.shape
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x has shape {tuple(x.shape)}; lora_a wants [T, {hidden}]")
    if lora_b.dim() != 3 or lora_b.shape[0] != num_slots or lora_b.shape[2] != rank:
        raise ValueError(
            f"lora_b has shape {tuple(lora_b.shape)}; lora_a wants [{num_slots}, N, {rank}]"
        )
    if tuple(out.shape) != (x.shape[0], lora_b.shape[1]):
        raise ValueError(
            f"out has shape {tuple(out.shape)}; want ({x.shape[0]}, {lora_b.shape[1]})"
        )
    mapping.check_fits(x.shape[0], num_slots)
