"""Temperature, top-k, top-p and min-p on the logits of the rows that sample.

Order and semantics follow transformers' warpers (and vLLM's sampler):
temperature, then top-k, then top-p, then min-p. Removed tokens get -inf.
Everything works in place on ``r`` [R, V], a tensor the sampler owns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from lorapool.engine.host_copy import to_device
from lorapool.protocol import SamplingParams

NEG_INF = float("-inf")
# Top-p looks for its nucleus among this many most likely tokens, then this
# many, and sorts the whole row only when they hold less than p of the mass.
TOP_P_CANDIDATES = (256, 4096)
# The sync-free top-p sorts rows whole, a chunk of rows at a time so that its workspace
# (per token: the sorted values and their indices, 12 bytes; the probabilities, their
# running sum and the mass before each, float64: 24) stays under this many bytes; the
# engine's activation reserve holds it (``kv_budget.activation_reserve``).
TOP_P_SORT_BYTES = 64 << 20
SORT_BYTES_PER_TOKEN = 36


def warp(r: torch.Tensor, params: Sequence[SamplingParams], sync_free: bool = False) -> None:
    """Apply temperature, top-k, top-p and min-p of ``params[i]`` to ``r[i]``.
    ``sync_free``: nothing read back from the device (``top_p``'s)."""
    vocab = r.shape[1]
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        r.div_(to_device(temps, r.device, r.dtype).unsqueeze(1))
    _on_rows(
        r,
        [i for i, p in enumerate(params) if 0 < p.top_k < vocab],
        lambda sub, idx: top_k(sub, [params[i].top_k for i in idx]),
    )
    _on_rows(
        r,
        [i for i, p in enumerate(params) if p.top_p < 1.0],
        lambda sub, idx: top_p(sub, [params[i].top_p for i in idx], sync_free),
    )
    _on_rows(
        r,
        [i for i, p in enumerate(params) if p.min_p > 0.0],
        lambda sub, idx: min_p(sub, [params[i].min_p for i in idx]),
    )


def _on_rows(
    r: torch.Tensor, idx: list[int], fn: Callable[[torch.Tensor, list[int]], None]
) -> None:
    """Run the in-place ``fn`` on the rows ``idx`` of ``r`` only."""
    if not idx:
        return
    if len(idx) == r.shape[0]:
        fn(r, idx)
        return
    rows = to_device(idx, r.device, torch.long)
    sub = r[rows]
    fn(sub, idx)
    r[rows] = sub


def top_k(r: torch.Tensor, ks: list[int]) -> None:
    """Keep each row's ``k`` largest logits (and ties with the k-th)."""
    k = to_device(ks, r.device, torch.long).unsqueeze(1)
    largest = r.topk(max(ks), dim=-1).values
    r.masked_fill_(r < largest.gather(1, k - 1), NEG_INF)


def top_p(r: torch.Tensor, ps: list[float], sync_free: bool = False) -> None:
    """Keep the smallest set of most likely tokens whose probability reaches ``p``.

    As transformers' TopPLogitsWarper: a token is removed when the tokens no
    more likely than it hold at most 1 - p, i.e. it is kept when the tokens
    strictly more likely than it hold less than p. At least one token is kept.
    The nucleus is looked for among the top TOP_P_CANDIDATES tokens first: which
    rows it settled is read back (the host waits for the device), and the rows it did
    not settle are sorted whole. ``sync_free``: every row sorted whole, nothing read
    back (as vLLM's sampler does), for a step that async scheduling leaves in flight;
    the same tokens kept. Rows sorted whole are sorted ``TOP_P_SORT_BYTES`` at a time
    (a 128k vocabulary: 14 rows), so that no batch of flat rows (a high temperature and
    top_p near 1) takes more memory than the engine reserved.
    """
    lse = r.logsumexp(dim=-1, keepdim=True)
    p = to_device(ps, r.device, torch.float64).unsqueeze(1)
    if sync_free:
        r.masked_fill_(r < _sorted_whole(r, lse, p), NEG_INF)
        return
    thresholds = torch.empty(r.shape[0], 1, dtype=r.dtype, device=r.device)
    todo = torch.arange(r.shape[0], device=r.device)
    for num in TOP_P_CANDIDATES:
        if num >= r.shape[1]:
            break
        rows = r if len(todo) == r.shape[0] else r[todo]
        found, done = _nucleus(rows, lse[todo], p[todo], num)
        thresholds[todo[done]] = found[done]
        todo = todo[~done]
        if len(todo) == 0:
            break
    if len(todo):
        thresholds[todo] = _sorted_whole(r, lse, p, None if len(todo) == r.shape[0] else todo)
    r.masked_fill_(r < thresholds, NEG_INF)


def _sorted_whole(r, lse, p, idx: torch.Tensor | None = None) -> torch.Tensor:
    """The least logit of each row's nucleus (of the rows ``idx``: all if None), the
    rows sorted whole ``TOP_P_SORT_BYTES`` at a time."""
    vocab = r.shape[1]
    count = r.shape[0] if idx is None else len(idx)
    step = max(1, TOP_P_SORT_BYTES // (SORT_BYTES_PER_TOKEN * vocab))
    found = []
    for start in range(0, count, step):
        at = slice(start, start + step) if idx is None else idx[start : start + step]
        found.append(_nucleus(r[at], lse[at], p[at], vocab)[0])
    return found[0] if len(found) == 1 else torch.cat(found)


def _nucleus(r: torch.Tensor, lse: torch.Tensor, p: torch.Tensor, num: int):
    """The least logit of each row's nucleus, if it lies in the top ``num``; which did."""
    values = r.topk(num, dim=-1).values
    probs = (values - lse).double().exp()
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely candidates
    num_kept = (before < p).sum(dim=-1)
    done = (num_kept < num) | (values[:, -1] == NEG_INF) | (num == r.shape[1])
    return values.gather(1, (num_kept - 1).unsqueeze(1)), done


def min_p(r: torch.Tensor, ms: list[float]) -> None:
    """Remove tokens less likely than ``min_p`` times the most likely one."""
    log_m = to_device([math.log(m) for m in ms], r.device, r.dtype)
    threshold = r.amax(dim=-1) + log_m
    r.masked_fill_(r < threshold.unsqueeze(1), NEG_INF)
