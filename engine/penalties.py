"""Logit penalties applied before temperature: repetition, frequency, presence, min_tokens;
and OpenAI's logit_bias, added before them (vLLM's order).

Semantics (vLLM's, which match transformers' and OpenAI's):
  repetition (HF style, over prompt + output tokens): l > 0 -> l / r, else l * r
  frequency  (OpenAI, over output tokens):            l -= f * count(token)
  presence   (OpenAI, over output tokens):            l -= p * [token occurred]
  min_tokens: while len(output) < min_tokens, EOS and stop_token_ids -> -inf

Everything is built from host values (the rows' token lists, their parameters) and
queued on the device: nothing is read back. Under async scheduling a row's last token
may not be read back yet (``PLACEHOLDER``): ``pending`` holds it on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING

import torch

from lorapool.engine.host_copy import to_device
from lorapool.engine.sequence import PLACEHOLDER

if TYPE_CHECKING:
    from lorapool.engine.sampler import SamplingRow


def needs_token_lists(row: SamplingRow) -> bool:
    """Whether ``row``'s penalties read its tokens (repetition, frequency, presence)."""
    p = row.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def needs_penalties(row: SamplingRow) -> bool:
    return needs_token_lists(row) or row.num_output_tokens < row.params.min_tokens


def apply_penalties(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    eos_token_ids: Sequence[int],
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``logits`` [S, V] with every row's penalties applied.

    The input is never modified: a copy is made when some row has a penalty,
    otherwise ``logits`` itself is returned. ``pending`` [S] (on the device): row i's
    token where its list holds ``PLACEHOLDER`` (its last).
    """
    if not any(needs_penalties(row) for row in rows):
        return logits
    x = logits.clone()
    repeat = [(i, r) for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    _repetition(x, repeat, pending)
    for name in ("frequency_penalty", "presence_penalty"):
        chosen = [(i, r) for i, r in enumerate(rows) if getattr(r.params, name) != 0.0]
        _subtract(x, chosen, name, pending)
    _min_tokens(x, rows, eos_token_ids)
    return x


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logits`` plus each row's ``logit_bias`` (a copy when some row has one, else
    ``logits`` itself); ids past the vocabulary are ignored."""
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return logits
    x = logits.clone()
    vocab = x.shape[1]
    for i, bias in biased:
        ids = [t for t in bias if t < vocab]
        if ids:
            values = to_device([bias[t] for t in ids], x.device, x.dtype)
            x[i, to_device(ids, x.device, torch.long)] += values
    return x


def _flat_index(
    x: torch.Tensor,
    rows: list[int],
    token_lists: list[Sequence[int]],
    pending: torch.Tensor | None = None,
):
    """(row index, token id) pairs of every token of every listed row, as tensors on
    x's device; a ``PLACEHOLDER`` takes its row's ``pending`` token there."""
    counts = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), counts)
    tok_idx = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    inside = tok_idx < x.shape[1]  # ids past the logits' vocab cannot be sampled anyway
    if not bool(inside.all()):  # host tensors: no read from the device
        row_idx, tok_idx = row_idx[inside], tok_idx[inside]
    held = tok_idx == PLACEHOLDER
    row_idx, tok_idx = to_device(row_idx, x.device), to_device(tok_idx, x.device)
    if pending is not None and bool(held.any()):  # -1: not finite (the request fails)
        filled = pending.index_select(0, row_idx).clamp(min=0, max=x.shape[1] - 1)
        tok_idx = torch.where(to_device(held, x.device), filled, tok_idx)
    return row_idx, tok_idx


def _rows(x: torch.Tensor, rows: list[tuple[int, SamplingRow]]) -> torch.Tensor:
    """The indices of ``rows`` on x's device."""
    return to_device([i for i, _ in rows], x.device, torch.long)


def _per_row(x: torch.Tensor, values: list[float]) -> torch.Tensor:
    """A [S] tensor holding ``values`` at the given rows (others unused)."""
    return to_device(values, x.device, x.dtype)


def _repetition(x: torch.Tensor, rows: list[tuple[int, SamplingRow]], pending=None) -> None:
    if not rows:
        return
    tokens = [r.token_ids for _, r in rows]
    r_idx, t_idx = _flat_index(x, [i for i, _ in rows], tokens, pending)
    if r_idx.numel() == 0:
        return
    penalty = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
    penalty[_rows(x, rows)] = _per_row(x, [r.params.repetition_penalty for _, r in rows])
    # Duplicate (row, token) pairs all write the same value, computed from the original.
    values, pen = x[r_idx, t_idx], penalty[r_idx]
    x[r_idx, t_idx] = torch.where(values > 0, values / pen, values * pen)


def _subtract(
    x: torch.Tensor, rows: list[tuple[int, SamplingRow]], name: str, pending=None
) -> None:
    """Lower each generated token's logit by the row's ``name`` penalty.

    frequency_penalty: once per occurrence (``index_put_`` with accumulate: a
    token seen c times is lowered c times); presence_penalty: once per token.
    """
    if not rows:
        return
    outputs = [r.output_token_ids for _, r in rows]
    r_idx, t_idx = _flat_index(x, [i for i, _ in rows], outputs, pending)
    if r_idx.numel() == 0:
        return
    penalty = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    penalty[_rows(x, rows)] = _per_row(x, [getattr(r.params, name) for _, r in rows])
    if name == "frequency_penalty":
        x.index_put_((r_idx, t_idx), -penalty[r_idx], accumulate=True)
    else:  # duplicate (row, token) pairs all write the same value
        x[r_idx, t_idx] = x[r_idx, t_idx] - penalty[r_idx]


def _min_tokens(x: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]) -> None:
    vocab = x.shape[1]
    active, banned = [], []
    for i, row in enumerate(rows):
        if row.num_output_tokens < row.params.min_tokens:
            ids = {t for t in chain(eos_token_ids, row.params.stop_token_ids) if 0 <= t < vocab}
            active.append(i)
            banned.append(sorted(ids))
    if active:
        r_idx, t_idx = _flat_index(x, active, banned)
        x[r_idx, t_idx] = float("-inf")
