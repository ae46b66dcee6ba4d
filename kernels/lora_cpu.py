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


def lora_linear(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    cpu_plan: CpuPlan,
    out: torch.Tensor,
    widths: list[int],
) -> None:
    """out += the LoRA update of x (shapes as in ``reference.lora_shrink/expand``).

    Any strides are correct; fastest with ``lora_a`` a view of slot-major
    [L, S, R, H_in] storage and ``lora_b`` a view of [L, R, N] storage, as
    the engine keeps them (``engine/lora/layers.py``).
    """
    slices = _slices(widths)
    merged = _slot_major(lora_a)  # [L, S * R, H_in] view, or None
    b_t = lora_b.transpose(1, 2)  # [L, R, N]
    for slot, start, end in cpu_plan.runs:
        _run(x[start:end], lora_a, merged, b_t[slot], slot, out[start:end], slices)
    if cpu_plan.grid is not None:
        _grid_update(x, lora_a, merged, b_t, cpu_plan.grid, out, slices)


def _run(xs, lora_a, merged, b_t, slot: int, rows: torch.Tensor, slices) -> None:
    """One adapter's run of tokens: ``rows += (xs @ A^T) @ B^T`` per slice, in place."""
    num_slices, _, rank, _ = lora_a.shape
    xs, b_t = xs.float(), b_t.float()  # [n, H_in], [R, N]
    if merged is not None:  # one matmul for every slice
        y = xs @ merged[slot].float().T  # [n, S * R]
        ys = [y[:, s * rank : (s + 1) * rank] for s in range(num_slices)]
    else:
        ys = list(torch.matmul(xs, lora_a[:, slot].float().transpose(1, 2)))
    if rows.dtype == torch.float32:
        for y_s, (o, n) in zip(ys, slices):
            rows[:, o : o + n].addmm_(y_s, b_t[:, o : o + n])
        return
    delta = torch.cat([y_s @ b_t[:, o : o + n] for y_s, (o, n) in zip(ys, slices)], 1)
    rows.copy_(rows.float() + delta)


def _grid_update(x, lora_a, merged, b_t, grid: SlotGrid, out, slices) -> None:
    """The grid's tokens: gather x, shrink and expand as batched matmuls over the
    grid's rows, then add the real cells into ``out``."""
    num_slices, _, rank, hidden = lora_a.shape
    g, m = grid.num_rows, grid.width
    xs = x.index_select(0, grid.tokens).float().view(g, m, hidden)
    if merged is not None:  # one matmul for all slices; A on the left streams it fastest
        y = torch.bmm(grid.weights(merged, 0).float(), xs.transpose(1, 2)).transpose(1, 2)
        ys = [y[:, :, s * rank : (s + 1) * rank] for s in range(num_slices)]  # [G, M, R]
    else:
        a = grid.weights(lora_a, 1).float()  # [S, G, R, H_in]
        ys = [torch.bmm(xs, a[s].transpose(1, 2)) for s in range(num_slices)]
    b_t = grid.weights(b_t, 0).float()  # [G, R, N]
    parts = [torch.bmm(y_s, b_t[:, :, o : o + n]) for y_s, (o, n) in zip(ys, slices)]
    delta = (parts[0] if num_slices == 1 else torch.cat(parts, -1)).view(g * m, -1)
    if grid.cells is not None:
        delta = delta.index_select(0, grid.cells)
    if out.dtype == torch.float32:
        out.index_add_(0, grid.targets, delta)
    else:
        summed = out.index_select(0, grid.targets).float() + delta
        out.index_copy_(0, grid.targets, summed.to(out.dtype))


def _slices(widths: list[int]) -> list[tuple[int, int]]:
    """(offset, width) of each slice."""
    return [(sum(widths[:s]), w) for s, w in enumerate(widths)]


def _slot_major(lora_a: torch.Tensor) -> torch.Tensor | None:
    """lora_a [S, L, R, H] as a [L, S * R, H] view when each slot's slices lie
    together in memory (the engine's buffers, at full rank), else None."""
    num_slices, num_slots, rank, hidden = lora_a.shape
    by_slot = lora_a.transpose(0, 1)
    if by_slot.stride()[1:] != (rank * hidden, hidden, 1):
        return None
    return by_slot.view(num_slots, num_slices * rank, hidden)
