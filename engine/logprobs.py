"""Logprobs of sampled tokens and of prompts (vLLM's semantics): those of the raw model
distribution, the log_softmax of the unprocessed logits; per row a dict of the chosen
token first (its rank counts the tokens at least as likely as it), then the top ``k``.

Computed on the device (``top_tensors``: two tensors, ids and values), then read back in
one copy each and made into dicts on the host (``dicts_of``). ``StepLogprobs`` holds a
step's for its rows that asked: read at once by the synchronous sampler, or copied
without waiting and read when async scheduling lands the step (``Sampler.on_device``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorapool.engine.host_copy import ReadBack, to_device
from lorapool.outputs import Logprob

_PROMPT_CHUNK = 512  # prompt positions per log_softmax, to bound memory


def raw_logprobs(logits: torch.Tensor, rows: list) -> tuple[list[int], torch.Tensor] | None:
    """(row indices, their log_softmax) for the rows (``SamplingRow``) that asked."""
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not asked:
        return None
    if len(asked) == len(rows):
        return asked, logits.log_softmax(dim=-1)
    idx = to_device(asked, logits.device, torch.long)
    return asked, logits[idx].log_softmax(dim=-1)


def top_tensors(logprobs: torch.Tensor, chosen: torch.Tensor, k: int):
    """Per row of ``logprobs`` [R, V] and its ``chosen`` token [R]: ids [R, 2 + k] (the
    token, its rank, the top ``k`` ids) and values [R, 1 + k] (its logprob, the top
    ``k``'s), on the device."""
    chosen = chosen.unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)
    ranks = (logprobs >= chosen_lp).sum(dim=-1, keepdim=True)
    if not k:
        return torch.cat([chosen, ranks], dim=1), chosen_lp
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([chosen, ranks, top_ids], dim=1), torch.cat([chosen_lp, top_values], dim=1)


def dicts_of(ids: list[list[int]], values: list[list[float]], ks: list[int]):
    """``top_tensors``' rows, read back, as dicts: the chosen token, then row i's top
    ``ks[i]`` with 1-based ranks."""
    dicts = []
    for row_ids, row_values, k in zip(ids, values, ks):
        d = {row_ids[0]: Logprob(row_values[0], row_ids[1])}
        for rank, (tid, value) in enumerate(zip(row_ids[2 : 2 + k], row_values[1 : 1 + k]), 1):
            d.setdefault(tid, Logprob(value, rank))
        dicts.append(d)
    return dicts


def logprob_dicts(
    logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]
) -> list[dict[int, Logprob]]:
    """Per row of ``logprobs`` [R, V]: the chosen token first, then the top ``ks[i]``."""
    ids, values = top_tensors(logprobs, chosen, max(ks))
    return dicts_of(ids.tolist(), values.tolist(), ks)


class StepLogprobs:
    """A step's logprobs, for its rows that asked: ``raw`` (``raw_logprobs``) and the
    tokens drawn [S] (before a non-finite row's -1: garbage there, the draw's padding
    past the vocabulary included, so clamped into it for the gather, then dropped).
    ``copy``: their copy to the host started now (``host_copy.ReadBack``), read by
    ``results`` without waiting for the work queued after it."""

    __slots__ = ("asked", "ks", "ids", "values")

    def __init__(self, raw, tokens: torch.Tensor, rows: list, copy: bool = False):
        asked, logprobs = raw
        self.asked = asked
        self.ks = [rows[i].params.logprobs for i in asked]
        chosen = tokens[to_device(asked, tokens.device, torch.long)]
        chosen = chosen.clamp(0, logprobs.shape[1] - 1)  # a non-finite row's garbage
        ids, values = top_tensors(logprobs, chosen, max(self.ks))
        self.ids, self.values = (ReadBack(ids), ReadBack(values)) if copy else (ids, values)

    def results(self, tokens: list[int]) -> dict[int, tuple[float, dict[int, Logprob]]]:
        """Row -> (its token's logprob, its dict), for the rows that asked and whose
        token (``tokens``: by row, -1 not finite) is good."""
        dicts = dicts_of(self.ids.tolist(), self.values.tolist(), self.ks)
        return {i: (d[tokens[i]].logprob, d) for i, d in zip(self.asked, dicts) if tokens[i] >= 0}


def prompt_logprobs(
    logits: torch.Tensor, prompt_token_ids: Sequence[int], k: int
) -> list[dict[int, Logprob] | None]:
    """Logprobs of the prompt: None for its first token, then per position the
    actual prompt token and the top ``k``. ``logits`` [P, V]: row i predicts token i+1."""
    result: list[dict[int, Logprob] | None] = [None]
    num = len(prompt_token_ids) - 1
    if num > logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for {num + 1} prompt tokens")
    targets = to_device(list(prompt_token_ids[1:]), logits.device, torch.long)
    for start in range(0, num, _PROMPT_CHUNK):
        end = min(num, start + _PROMPT_CHUNK)
        logprobs = logits[start:end].float().log_softmax(dim=-1)
        result.extend(logprob_dicts(logprobs, targets[start:end], [k] * (end - start)))
    return result
