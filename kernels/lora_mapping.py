"""Tokens of a batch grouped by LoRA slot: built once per step, used by every layer.

A batch mixes adapters; slot[t] is token t's adapter slot (-1: base model only).
The kernels want tokens of one adapter next to each other, so that a prefill
segment becomes matrix tiles over one adapter's weights and the decode tokens
of one adapter share a single read of them. The grouping is the same for every
LoRA projection of every layer in a step, so it is computed once, on the host
(the scheduler builds slot indices in Python anyway: no device sync), and sent
to the device in a single copy.
"""

from dataclasses import dataclass, field
from functools import cached_property

import torch

from lorapool.kernels.lora_cpu import CpuPlan, plan

# Rows of a tile in the LoRA kernels, by the longest run of tokens of one adapter.
_BLOCK_M_STEPS = (16, 32, 64)


@dataclass(frozen=True)
class LoRAMapping:
    """Token order and tiles for the LoRA kernels.

    Attributes:
        num_tokens: T, tokens in the batch.
        max_slot: the largest slot used (-1 when no token has an adapter).
        segments: (slot, start, end) per adapter, slot >= 0: tokens
            ``order[start:end]`` use that slot. Base-model tokens are in none.
        order: [T] int64, token indices sorted by slot (stable), on the device.
        tiles: [3, num_tiles] int64 rows (start, end, slot): each tile is
            ``order[start:min(start + block_m, end)]``, all of one slot.
        block_m: rows per tile.
        host_slots: the slot of each token, on the host (the CPU path plans from it).
        live_tiles: how many tiles are expected to hold tokens when ``tiles`` is
            padded with empty ones (a CUDA graph's, ``engine.cuda_graphs``); None
            when every tile is live. Sizes work (split-K), never decides results.
    """

    num_tokens: int
    max_slot: int
    segments: tuple[tuple[int, int, int], ...]
    order: torch.Tensor
    tiles: torch.Tensor
    block_m: int
    host_slots: tuple[int, ...] = field(default=(), compare=False, repr=False)
    live_tiles: int | None = None

    @classmethod
    def from_slots(cls, slots, device: torch.device | str | None = None) -> "LoRAMapping":
        """Builds the mapping from slot indices: a list, or a [T] integer tensor.

        A CUDA tensor is copied to the host first (a sync); pass a list or a CPU
        tensor and ``device`` to avoid it.
        """
        if isinstance(slots, torch.Tensor):
            device = slots.device if device is None else device
            slots = slots.detach().to("cpu", torch.int64).reshape(-1)
        else:
            slots = torch.tensor(list(slots), dtype=torch.int64)
        if slots.numel() and int(slots.min()) < -1:
            raise ValueError(f"LoRA slots must be >= -1; got {int(slots.min())}")
        sorted_slots, order = torch.sort(slots, stable=True)
        values, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
        segments = _segments(values.tolist(), counts.tolist())
        block_m = _block_m(segments)
        tiles = _tiles(segments, block_m)
        meta = torch.cat([order, torch.tensor(tiles, dtype=torch.int64).reshape(-1)])
        meta = meta.to(device if device is not None else "cpu")
        num_tokens = slots.numel()
        return cls(
            num_tokens=num_tokens,
            max_slot=int(values[-1]) if values.numel() else -1,
            segments=segments,
            order=meta[:num_tokens],
            tiles=meta[num_tokens:].view(3, -1),
            block_m=block_m,
            host_slots=tuple(slots.tolist()),
        )

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[1]

    @property
    def work_tiles(self) -> int:
        """Tiles to size the kernels' work by: the live ones, or all when none are padding."""
        return self.num_tiles if self.live_tiles is None else min(self.live_tiles, self.num_tiles)

    @property
    def device(self) -> torch.device:
        return self.order.device

    def check_fits(self, num_tokens: int, num_slots: int) -> None:
        """Raise ValueError unless this mapping covers ``num_tokens`` tokens with
        slots below ``num_slots``."""
        if self.num_tokens != num_tokens:
            raise ValueError(
                f"the LoRA mapping has {self.num_tokens} tokens, the batch {num_tokens}"
            )
        if self.max_slot >= num_slots:
            raise ValueError(
                f"LoRA slot {self.max_slot} is out of range: the weights have {num_slots} slots"
            )

    def token_indices(self, start: int, end: int) -> torch.Tensor:
        """[end - start] int64 indices of the tokens of one segment."""
        return self.order[start:end]

    @cached_property
    def cpu_plan(self) -> CpuPlan:
        """How the CPU path runs this step's LoRA update (``lora_cpu``); built once."""
        return plan(list(self.host_slots))


def as_mapping(slots, device: torch.device) -> LoRAMapping:
    """``slots`` if it is already a mapping, else the mapping built from it."""
    if isinstance(slots, LoRAMapping):
        return slots
    return LoRAMapping.from_slots(slots, device)


def _segments(values: list[int], counts: list[int]) -> tuple[tuple[int, int, int], ...]:
    segments, start = [], 0
    for slot, count in zip(values, counts):
        if slot >= 0:
            segments.append((slot, start, start + count))
        start += count
    return tuple(segments)


def _block_m(segments) -> int:
    longest = max((end - start for _, start, end in segments), default=1)
    return next((b for b in _BLOCK_M_STEPS if longest <= b), _BLOCK_M_STEPS[-1])


def _tiles(segments, block_m: int) -> list[list[int]]:
    starts, ends, slots = [], [], []
    for slot, start, end in segments:
        for tile_start in range(start, end, block_m):
            starts.append(tile_start)
            ends.append(end)
            slots.append(slot)
    return [starts, ends, slots]
