"""The CPU path of the LoRA update: shrink and expand fused, planned once a step.

Semantics (those of ``reference.lora_shrink`` followed by ``reference.lora_expand``):
for every token t with slot[t] >= 0 and every slice s,
``out[t, o_s : o_s + n_s] += (x[t] @ A[s, slot[t]]^T) @ B[slot[t], o_s : o_s + n_s]^T``,
summed in float32; rows of base-model tokens (slot -1) are not touched.

A step's tokens take one of two routes, decided once per step (``CpuPlan``)
and shared by every projection of every layer:

- A run of more than ``RUN_MIN`` consecutive tokens of one adapter (a prefill
  chunk) is plain matmuls on slices of ``x`` and ``out``: no gather, and the
  expand adds into ``out`` in place.
- The other tokens (decode tokens, a few per adapter) are grouped by slot
  into a padded [G, M] grid: one batched matmul for the shrink of all slices
  (A is slot-major) and one per slice for the expand. This work is bound by
  reading the adapters' weights (M is a handful of tokens), so the grid's G
  rows are a contiguous range of slots read in place from the weight buffers
  whenever that range is at most twice the number of slots in use; only a
  sparse set of slots is gathered, since a gather writes the weights out and
  reads them a second time. B is read as [R, N] matrices (rank-major
  storage), a few percent faster than [N, R] rows of R floats.

Grid padding, and rows of slots in a range that have no token this step, are
computed and then dropped: only real tokens' rows reach ``out``. So a slot
holding a broken adapter (NaN weights) can only harm its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import torch

# Runs of consecutive same-slot tokens longer than this take the matmul route.
RUN_MIN = 16


@dataclass(frozen=True)
class SlotGrid:
    """Short tokens grouped by slot and padded to [G, M].

    Attributes:
        first_slot: with ``slots`` None, the rows are slots
            ``first_slot .. first_slot + G - 1`` (a view of the weights).
        slots: [G] int64 slots of the rows, when they must be gathered.
        num_rows, width: G and M.
        tokens: [G * M] int64 token of each grid cell (padding: any real token).
        cells: [n] int64 the grid cells holding real tokens, in order; None
            when every cell does (no padding).
        targets: [n] int64 the token of each of those cells.
    """

    first_slot: int
    slots: torch.Tensor | None
    num_rows: int
    width: int
    tokens: torch.Tensor
    cells: torch.Tensor | None
    targets: torch.Tensor

    def weights(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        """The rows' slots of ``w`` (slot dimension ``dim``): a view when possible."""
        if self.slots is None:
            return w.narrow(dim, self.first_slot, self.num_rows)
        return w.index_select(dim, self.slots)


@dataclass(frozen=True)
class CpuPlan:
    runs: tuple[tuple[int, int, int], ...]  # (slot, start, end) of long runs
    grid: SlotGrid | None


def plan(host_slots: list[int]) -> CpuPlan:
    """Splits a step's tokens into long runs and a slot grid (see the module doc)."""
    runs, short = [], {}
    start = 0
    for slot, group in groupby(host_slots):
        end = start + sum(1 for _ in group)
        if slot >= 0:
            if end - start > RUN_MIN:
                runs.append((slot, start, end))
            else:
                short.setdefault(slot, []).extend(range(start, end))
        start = end
    return CpuPlan(tuple(runs), _grid(short) if short else None)


def _grid(short: dict[int, list[int]]) -> SlotGrid:
    active = sorted(short)
    span = active[-1] - active[0] + 1
    rows = list(range(active[0], active[-1] + 1)) if span <= 2 * len(active) else active
    width = max(len(tokens) for tokens in short.values())
    any_token = short[active[0]][0]
    tokens, cells, targets = [], [], []
    for g, slot in enumerate(rows):
        row = short.get(slot, [])
        tokens += row + [any_token] * (width - len(row))
        cells += range(g * width, g * width + len(row))
        targets += row
    as_long = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return SlotGrid(
        first_slot=rows[0],
        slots=None if rows is not active else as_long(rows),
        num_rows=len(rows),
        width=width,
        tokens=as_long(tokens),
        cells=None if len(cells) == len(tokens) else as_long(cells),
        targets=as_long(targets),
    )


@dataclass(frozen=True)
class SlotWeights:
    """One projection's adapter weights as the CPU path reads them.

    Built once per layer and step rank by the engine (``LoRALayer``), or per
    call by ``kernels.lora_linear``, so that a call does no layout work.

    Attributes:
        a: [S, L, R, H_in], each slice's A.
        merged: [L, S * R, H_in], the same A as one matrix per slot, a view when
            each slot's slices lie together in memory (the engine's buffers at
            full rank), else None.
        b: [L, R, N], each slot's B^T (a view of rank-major storage is fastest).
        slices: (offset, width) of each slice's columns in ``out`` and ``b``.
    """

    a: torch.Tensor
    merged: torch.Tensor | None
    b: torch.Tensor
    slices: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, lora_a: torch.Tensor, lora_b: torch.Tensor, widths) -> SlotWeights:
        """From ``lora_a`` [S, L, R, H_in] and ``lora_b`` [L, N, R] (the kernels' shapes)."""
        offsets = [sum(widths[:s]) for s in range(len(widths))]
        return cls(lora_a, _slot_major(lora_a), lora_b.transpose(1, 2), tuple(zip(offsets, widths)))


def lora_linear(x: torch.Tensor, weights: SlotWeights, cpu_plan: CpuPlan, out: torch.Tensor):
    """out += the LoRA update of x (the semantics in the module doc).

    Any strides are correct; fastest with the engine's layout (slot-major A,
    rank-major B, see ``engine/lora/layers.py``).
    """
    for slot, start, end in cpu_plan.runs:
        _run(x[start:end], weights, slot, out[start:end])
    if cpu_plan.grid is not None:
        _grid_update(x, weights, cpu_plan.grid, out)


def _run(xs, w: SlotWeights, slot: int, rows: torch.Tensor) -> None:
    """One adapter's run of tokens: ``rows += (xs @ A^T) @ B^T`` per slice, in place."""
    rank = w.a.shape[2]
    xs, b_t = _f32(xs), _f32(w.b[slot])  # [n, H_in], [R, N]
    if w.merged is not None:  # one matmul for every slice
        y = xs @ _f32(w.merged[slot]).T  # [n, S * R]
        ys = [y[:, s * rank : (s + 1) * rank] for s in range(len(w.slices))]
    else:
        ys = list(torch.matmul(xs, _f32(w.a[:, slot]).transpose(1, 2)))
    if rows.dtype == torch.float32:
        for y_s, (o, n) in zip(ys, w.slices):
            rows[:, o : o + n].addmm_(y_s, b_t[:, o : o + n])
        return
    delta = torch.cat([y_s @ b_t[:, o : o + n] for y_s, (o, n) in zip(ys, w.slices)], 1)
    rows.copy_(rows.float() + delta)


def _grid_update(x, w: SlotWeights, grid: SlotGrid, out) -> None:
    """The grid's tokens: gather x, shrink and expand as batched matmuls over the
    grid's rows, then add the real cells into ``out``."""
    num_slices, _, rank, hidden = w.a.shape
    xs = _f32(x.index_select(0, grid.tokens)).view(grid.num_rows, grid.width, hidden)
    if w.merged is not None:  # one matmul for all slices; A on the left streams it fastest
        y = torch.bmm(_f32(grid.weights(w.merged, 0)), xs.transpose(1, 2)).transpose(1, 2)
        ys = [y[:, :, s * rank : (s + 1) * rank] for s in range(num_slices)]  # [G, M, R]
    else:
        a = _f32(grid.weights(w.a, 1))  # [S, G, R, H_in]
        ys = [torch.bmm(xs, a[s].transpose(1, 2)) for s in range(num_slices)]
    b_t = _f32(grid.weights(w.b, 0))  # [G, R, N]
    if num_slices == 1:
        delta = torch.bmm(ys[0], b_t)
    else:
        parts = [torch.bmm(y_s, b_t[:, :, o : o + n]) for y_s, (o, n) in zip(ys, w.slices)]
        delta = torch.cat(parts, -1)
    delta = delta.view(grid.num_rows * grid.width, -1)
    if grid.cells is not None:
        delta = delta.index_select(0, grid.cells)
    if out.dtype == torch.float32:
        out.index_add_(0, grid.targets, delta)
    else:
        summed = out.index_select(0, grid.targets).float() + delta
        out.index_copy_(0, grid.targets, summed.to(out.dtype))


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _slot_major(lora_a: torch.Tensor) -> torch.Tensor | None:
    """lora_a [S, L, R, H] as a [L, S * R, H] view when each slot's slices lie
    together in memory (the engine's buffers, at full rank), else None."""
    num_slices, num_slots, rank, hidden = lora_a.shape
    by_slot = lora_a.transpose(0, 1)
    if by_slot.stride()[1:] != (rank * hidden, hidden, 1):
        return None
    return by_slot.view(num_slots, num_slices * rank, hidden)
