"""LoRA on a packed projection: stacked per-slot weights and the shrink/expand update.

Ranks: every slot's A and B are zero-padded to ``max_lora_rank`` in the
buffers, and a step runs at the largest rank among the adapters *of that
step's tokens* (a view of the first ``rank`` columns, no copy), so a rank-64
adapter resident in a slot but idle costs a rank-8 step nothing. Padding costs
(step_rank - r) extra multiply-adds per token and slice for an adapter of
rank r; grouping by rank would save that at the price of one kernel launch per
rank group and projection. With a handful of ranks in flight the padded
single launch is the cheaper of the two on the GPU, and on the CPU the waste
is bounded by the rank spread of the adapters in the same step.
"""

from __future__ import annotations

import torch

from lorapool import kernels
from lorapool.kernels import LoRAMapping, lora_cpu
from lorapool.kernels.lora_cpu import SlotWeights


def stage(
    a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype, pin: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A slice as the slot buffers hold it: (A [r, in], scaling * B^T [r, out]) in ``dtype``.

    ``pin``: in page-locked host memory, so that copies to the GPU run asynchronously
    (a copy from ordinary memory waits for the GPU, then copies).
    """
    a = a.to(dtype).contiguous()
    b_t = (b * scaling).T.to(dtype).contiguous()
    return (a.pin_memory(), b_t.pin_memory()) if pin else (a, b_t)


class LoRAStep:
    """The per-step state every LoRA layer reads: token mapping and active rank, and
    whether the kernels take the live-work path (``EngineArgs.lora_live_work``)."""

    def __init__(self, live_work: bool = False):
        self.mapping: LoRAMapping | None = None
        self.rank = 0
        self.live_work = live_work

    def set(self, mapping: LoRAMapping | None, rank: int) -> None:
        self.mapping = mapping if mapping is not None and mapping.max_slot >= 0 else None
        self.rank = rank


class LoRALayer:
    """The adapter weights of one ``PackedLinear`` for every device slot.

    ``lora_a``: [L, S, R, H_in] (L slots, S packed slices, R = max_lora_rank),
    slot-major so that one slot's slices are one matrix for the CPU path; the
    kernels get it as an [S, L, R, H_in] view.
    ``lora_b``: [L, R, N], the slices' B matrices stacked along N = out_features,
    each transposed, with the adapter's scaling folded in; the kernels get it
    as an [L, N, R] view. Stored rank-major so that a slot's B^T is a plain
    [R, N] matrix: the CPU expand reads it a few percent faster than [N, R]
    rows of R floats (benchmarks/RESULTS.md, "CPU engine"), and a Triton tile
    loads it contiguously along N. Entries of an adapter that does not target
    a slice are zero.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        step: LoRAStep,
    ):
        num_slices = len(output_sizes)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:s]) for s in range(num_slices)]
        self.lora_a = torch.zeros(
            num_slots, num_slices, max_rank, in_features, dtype=dtype, device=device
        )
        self.lora_b = torch.zeros(
            num_slots, max_rank, sum(output_sizes), dtype=dtype, device=device
        )
        self.step = step
        self._cpu_weights: dict[int, SlotWeights] = {}  # views of the buffers, by step rank

    def set_slot(
        self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor, scaling: float
    ) -> None:
        """Write slice ``index`` of ``slot``: A [r, in], B [out, r] (B scaled here)."""
        self.clear_slice(slot, index)
        self.write_staged(slot, index, *stage(a, b, scaling, self.lora_a.dtype))

    def clear_slice(self, slot: int, index: int) -> None:
        start, width = self.offsets[index], self.output_sizes[index]
        self.lora_a[slot, index].zero_()
        self.lora_b[slot, :, start : start + width].zero_()

    def write_staged(self, slot: int, index: int, a: torch.Tensor, b_t: torch.Tensor) -> None:
        """Copy a staged slice (``stage``) into ``slot``, the slice's other entries left as
        they are (zero after ``clear_slot``); non-blocking from pinned host memory."""
        rank, start = a.shape[0], self.offsets[index]
        self.lora_a[slot, index, :rank].copy_(a, non_blocking=True)
        self.lora_b[slot, :rank, start : start + b_t.shape[1]].copy_(b_t, non_blocking=True)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[t] += x[t] @ A[slot[t]]^T @ B[slot[t]]^T per slice; base tokens untouched."""
        mapping, rank = self.step.mapping, self.step.rank
        if mapping is None or rank == 0:
            return out
        x = x.to(self.lora_a.dtype)
        if kernels.use_triton(x):
            lora_a = self.lora_a[:, :, :rank].transpose(0, 1)
            lora_b = self.lora_b[:, :rank].transpose(1, 2)
            kernels.lora_linear(
                x, lora_a, lora_b, mapping, out, self.output_sizes, self.step.live_work
            )
        else:  # the layout work of a call done once per rank: 120 calls a step add up
            lora_cpu.lora_linear(x, self._cpu_weights_at(rank), mapping.cpu_plan, out)
        return out

    def _cpu_weights_at(self, rank: int) -> SlotWeights:
        weights = self._cpu_weights.get(rank)
        if weights is None:
            lora_a = self.lora_a[:, :, :rank].transpose(0, 1)
            lora_b = self.lora_b[:, :rank].transpose(1, 2)
            weights = SlotWeights.of(lora_a, lora_b, self.output_sizes)
            self._cpu_weights[rank] = weights
        return weights
