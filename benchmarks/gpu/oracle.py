"""Greedy generation by transformers (the oracle) and by our engine, and their comparison."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from .models import EOS


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' ``generate``, greedy, one request alone, stopping at EOS."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def top2_margin(model, token_ids: list[int]) -> float:
    """The oracle's top-1 minus top-2 logit after ``token_ids``: how near a tie it was."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([token_ids], device=device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@torch.inference_mode()
def hf_top(model, token_ids: list[int], k: int) -> set[int]:
    """The oracle's ``k`` most likely next tokens after ``token_ids``."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([token_ids], device=device)).logits[0, -1].float()
    return set(torch.topk(logits, k).indices.tolist())


def make_engine(path, device: str, dtype: str, **options):
    from lorapool import EngineArgs, LLMEngine

    options.setdefault("kv_cache_memory", 1 << 30 if device == "cuda" else 64 << 20)
    return LLMEngine.from_engine_args(
        EngineArgs(model=str(path), device=device, dtype=dtype, **options)
    )


def engine_greedy(engine, prompts, max_new_tokens: int, loras=None) -> list[list[int]]:
    """Every request in one continuous batch; the new token ids of each, in order."""
    return engine_greedy_top(engine, prompts, max_new_tokens, loras)[0]


def engine_greedy_top(
    engine, prompts, max_new_tokens: int, loras=None, k: int | None = None, **extra
) -> tuple[list[list[int]], list[list[set[int]]] | None]:
    """``engine_greedy``, and with ``k`` each position's top-``k`` token ids (the
    engine's own logprobs of the raw distribution, as vLLM's ``logprobs=k``)."""
    outs = engine_greedy_outputs(engine, prompts, max_new_tokens, loras, k, **extra)
    tokens = [ids for ids, _ in outs]
    return tokens, ([tops_of(lps, k) for _, lps in outs] if k is not None else None)


def engine_greedy_outputs(
    engine, prompts, max_new_tokens: int, loras=None, k: int | None = None, **extra
) -> list[tuple[list[int], list[dict] | None]]:
    """Every request in one continuous batch: (new token ids, their logprobs) of each."""
    from lorapool import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=k, **extra)
    loras = loras or [None] * len(prompts)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                first = out.outputs[0]
                done[out.request_id] = (list(first.token_ids), first.logprobs)
    return [done[f"r{i}"] for i in range(len(prompts))]


def tops_of(logprobs: list[dict], k: int) -> list[set[int]]:
    """Each position's top-``k`` token ids, from vLLM-style logprobs (the sampled
    token rides along outside the top ``k``; its rank says so)."""
    return [{t for t, lp in d.items() if lp.rank is None or lp.rank <= k} for d in logprobs]


def logprob_gap(a: list[int], a_lps: list[dict], b: list[int], b_lps: list[dict]) -> float:
    """How far two runs' logprobs lie apart where both runs saw the same context: every
    position up to and including the first where their tokens part.

    At each such position, the largest of: the difference in the logprob of each token
    both runs report, and the difference between the r-th largest logprob of each run
    for every rank r both report. The ranked values are there for two distributions
    whose top tokens share none (a random-weight model with a wrong adapter can move
    every one of them): each is continuous in the logits, so rounding moves it by
    rounding's size and a real change by the change's.
    """
    part = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)) - 1)
    gap = 0.0
    for pos in range(part + 1):
        mine, theirs = a_lps[pos], b_lps[pos]
        for token in mine.keys() & theirs.keys():
            gap = max(gap, abs(mine[token].logprob - theirs[token].logprob))
        for x, y in zip(_ranked(mine), _ranked(theirs)):
            gap = max(gap, abs(x - y))
    return gap


def _ranked(logprobs: dict) -> list[float]:
    """One position's logprobs, largest first (each token once, whatever its rank says)."""
    return sorted((lp.logprob for lp in logprobs.values()), reverse=True)


def not_near_ties(ours, theirs, our_tops, their_top) -> list[str]:
    """Each first difference that is not a near tie, described (empty: all close).

    A near tie, as vLLM's ``check_logprobs_close`` judges one: at the first
    position where the two greedy runs part, each run's token is among the
    other's top-k there. ``their_top(i, pos)`` gives the other side's top-k set
    (computed on demand: the oracle's forward pass over the shared prefix).
    """
    bad = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is None:
            if len(a) != len(b):
                bad.append(f"request {i}: {len(a)} tokens against {len(b)}")
            continue
        mine_in_theirs = a[pos] in their_top(i, pos)
        theirs_in_mine = b[pos] in our_tops[i][pos]
        if not (mine_in_theirs and theirs_in_mine):
            bad.append(
                f"request {i} token {pos}: {a[pos]} vs {b[pos]} "
                f"(ours in theirs' top: {mine_in_theirs}, theirs in ours': {theirs_in_mine})"
            )
    return bad


def free(*objects) -> None:
    """Collect garbage and return cached device memory.

    Deleting the arguments here cannot drop the caller's own names for them:
    callers ``del`` (or rebind) theirs first, then call this.
    """
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Agreement:
    """Token agreement of ours against the oracle's, request by request."""

    exact: int  # requests equal token for token
    total: int
    matched: int  # tokens before the first difference, summed
    tokens: int  # oracle tokens, summed
    first_diffs: list[tuple[int, int]]  # (request, position) of each first difference

    @property
    def share(self) -> float:
        return round(self.matched / max(1, self.tokens), 4)

    def exact_first(self, k: int, ours, theirs) -> bool:
        return all(a[:k] == b[:k] for a, b in zip(ours, theirs))


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> Agreement:
    exact, matched, tokens, diffs = 0, 0, 0, []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a == b:
            exact += 1
        else:
            diffs.append((i, n))
        matched += n
        tokens += len(b)
    return Agreement(exact, len(theirs), matched, tokens, diffs)
