"""The next token of every running sequence, and the logprobs asked for.

Per row (vLLM's semantics):
  1. logprobs, when asked, are those of the raw model distribution
     (log_softmax of the unprocessed logits);
  2. logit_bias, penalties and min_tokens (``penalties.py``);
  3. a structured output's grammar: tokens it does not allow -> -inf (``guide.py``);
     rows without one are not touched;
  4. greedy rows (temperature < 1e-5) take the argmax;
  5. the others: temperature, top-k, top-p, min-p (``warpers.py``), then a draw.

The draw inverts the CDF of the processed distribution with one uniform
number u in (0, 1] per row. A row whose request has a ``seed`` derives u only
from (seed, seq_index, number of tokens generated so far): it samples the same
tokens alone or in any batch, after recomputation, or on another worker that
resumes it. Other rows take u from the sampler's own generator.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from lorapool.engine.guide import apply_masks
from lorapool.engine.host_copy import to_device
from lorapool.engine.logprobs import StepLogprobs, raw_logprobs
from lorapool.engine.penalties import apply_logit_bias, apply_penalties
from lorapool.engine.sequence import PromptAndOutput
from lorapool.engine.warpers import warp
from lorapool.outputs import Logprob
from lorapool.protocol import SamplingParams

_MASK64 = (1 << 64) - 1
_BLOCK = 256  # the draw first picks a block of this many tokens, then a token in it


class SamplingRow(PromptAndOutput):
    """One sequence to sample a token for, this step: its params, its tokens (prompt,
    then those generated before this step), which of the request's n completions it
    is, and its grammar's allowed tokens ([V] bool, or None).

    Only penalties read the token lists, so a row made by ``of_tokens`` holds the
    sequence's own list and copies nothing (a step makes one per running sequence).
    """

    __slots__ = ("params", "token_ids", "num_prompt_tokens", "seq_index", "allowed")

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        seq_index: int = 0,
        allowed: torch.Tensor | None = None,
    ):
        self.params = params
        self.token_ids = [*prompt_token_ids, *output_token_ids]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.seq_index = seq_index
        self.allowed = allowed

    @classmethod
    def of_tokens(
        cls,
        params: SamplingParams,
        token_ids: list[int],
        num_prompt_tokens: int,
        seq_index: int = 0,
        allowed: torch.Tensor | None = None,
    ) -> SamplingRow:
        """A row over ``token_ids`` (prompt + output, not copied: not to change
        until the row is sampled)."""
        row = cls.__new__(cls)
        row.params, row.token_ids, row.num_prompt_tokens = params, token_ids, num_prompt_tokens
        row.seq_index, row.allowed = seq_index, allowed
        return row


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # raw log-softmax of the chosen token; None unless asked
    top_logprobs: dict[int, Logprob] | None  # chosen + top-`logprobs`, 1-based ranks


class Sampler:
    """Samples one token per row of a [S, V] logits tensor; never modifies it.

    A row whose logits hold NaN or Inf gets token_id -1 and no logprobs: what was
    drawn from it is garbage. Its check is read back in the same device-to-host copy
    as the tokens; the host values it needs on the device go there without waiting
    (``host_copy``), so a step's sampling waits on the device once, unless it reads
    more back: logprobs (two copies), top-p's candidate search (which rows it settled),
    a grammar row's check for an empty mask.
    """

    def __init__(self, eos_token_ids: Iterable[int], seed: int = 0):
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return []
        logits = logits.float()
        finite = finite_rows(logits)
        raw = raw_logprobs(logits, rows)
        processed = apply_masks(self._processed(logits, rows), rows, fallback=logits)
        tokens = self._sample(processed, rows, owned=processed is not logits)
        return _results(tokens, finite, raw, rows)

    def _processed(self, logits, rows, pending: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` with each row's logit_bias, then its penalties (a copy if any)."""
        biased = apply_logit_bias(logits, rows)
        return apply_penalties(biased, rows, self.eos_token_ids, pending)

    def on_device(
        self, logits: torch.Tensor, rows: list[SamplingRow], pending: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, StepLogprobs | None]:
        """[S] int64 on the device: each row's token, -1 where the row is not finite,
        queued without waiting for the device, nothing read back (async scheduling
        reads it later); and the logprobs of the rows that asked, their copy to the host
        started. For rows without a grammar (its mask needs the token before). A row's
        last token may be one not read back yet (``PLACEHOLDER``): ``pending`` [S] holds
        it on the device, for the penalties."""
        logits = logits.float()
        raw = raw_logprobs(logits, rows)
        processed = self._processed(logits, rows, pending)
        tokens = self._sample(processed, rows, owned=processed is not logits, sync_free=True)
        found = StepLogprobs(raw, tokens, rows, copy=True) if raw is not None else None
        return torch.where(finite_rows(logits), tokens, -1), found

    def _sample(
        self, x: torch.Tensor, rows: list[SamplingRow], owned: bool, sync_free: bool = False
    ) -> torch.Tensor:
        """The token of every row; ``owned``: x may be overwritten; ``sync_free``: nothing
        read back from the device (``warp``'s)."""
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if len(greedy) == len(rows):
            return x.argmax(dim=-1)
        if not greedy:  # every row samples: no index tensors, no gathers
            r = x if owned else x.clone()
            warp(r, [row.params for row in rows], sync_free)
            return draw(r, to_device(self._uniforms(rows), x.device))
        tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
        idx = to_device(greedy, x.device, torch.long)
        tokens[idx] = x[idx].argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        idx = to_device(sampled, x.device, torch.long)
        r = x[idx]
        warp(r, [rows[i].params for i in sampled], sync_free)
        tokens[idx] = draw(r, to_device(self._uniforms([rows[i] for i in sampled]), x.device))
        return tokens

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One number in (0, 1] per row, float64 on the CPU."""
        u = 1.0 - torch.rand(len(rows), dtype=torch.float64, generator=self.generator)
        seeded = [i for i, row in enumerate(rows) if row.params.seed is not None]
        if seeded:  # one tensor write: one a row cost more than the hashes
            values = [
                seeded_uniform(r.params.seed, r.seq_index, r.num_output_tokens)
                for r in (rows[i] for i in seeded)
            ]
            u[seeded] = torch.tensor(values, dtype=torch.float64)
        return u


def argmax_only(params: SamplingParams) -> bool:
    """Whether a row of ``params`` takes the argmax of the raw logits, untouched: greedy,
    no logprobs, no logit_bias, no penalties (min_tokens, which ends, is checked per row)."""
    return (
        params.greedy
        and params.logprobs is None
        and not params.logit_bias
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


def finite_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits`` [S, V]: its argmax, or -1 where the row holds NaN or Inf.

    [S] int64 on the logits' device, queued right after the forward, so that the
    greedy step's only sync is one copy of it to the host. A row is
    finite iff sum(row * 0) is (0 * NaN and 0 * Inf are NaN): on the CPU that costs a
    third of ``isfinite(row).all()``, which reduces over bools.
    """
    return torch.where(finite_rows(logits), logits.argmax(dim=-1), -1)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[S] bool: whether each row of ``logits`` [S, V] is free of NaN and Inf."""
    return logits.mul(0).sum(dim=-1).isfinite()


def seeded_uniform(seed: int, seq_index: int, step: int) -> float:
    """A number in (0, 1], a pure function of its arguments (splitmix64 mixing)."""
    h = _mix(_seed_prefix(seed, seq_index) ^ (step & _MASK64))
    return ((h >> 11) + 1) / float(1 << 53)


@functools.lru_cache(maxsize=1 << 14)
def _seed_prefix(seed: int, seq_index: int) -> int:
    """The mixing of (seed, seq_index), the same at every step of a sequence."""
    return _mix(_mix(seed & _MASK64) ^ (seq_index & _MASK64))


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw(r: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample from softmax(r) per row by inverting its CDF at ``u`` [R] in (0, 1].

    Two levels keep the float error small: block sums pick a block of _BLOCK
    tokens, then a float64 cumsum inside it picks the token. A token of
    probability 0 (logit -inf) is never chosen. ``r`` is overwritten.
    """
    num_rows, vocab = r.shape
    weights = r.sub_(r.amax(dim=-1, keepdim=True)).exp_()
    pad = -vocab % _BLOCK
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))
    blocks = weights.view(num_rows, -1, _BLOCK)
    ends = blocks.sum(dim=-1).double().cumsum(dim=-1)  # cdf at the end of each block
    target = u.unsqueeze(1) * ends[:, -1:]
    # The first block whose end reaches the target starts strictly below it.
    block = torch.searchsorted(ends, target).clamp_(max=blocks.shape[1] - 1)
    starts = torch.nn.functional.pad(ends, (1, 0))
    rest = target - starts.gather(1, block)
    inner = blocks[torch.arange(num_rows, device=r.device), block.squeeze(1)].double().cumsum(-1)
    rest = torch.minimum(rest, inner[:, -1:])
    token = torch.searchsorted(inner, rest).clamp_(max=_BLOCK - 1)
    return (block * _BLOCK + token).squeeze(1)


def _results(
    tokens: torch.Tensor, finite: torch.Tensor, raw, rows: list[SamplingRow]
) -> list[SampleResult]:
    token_list = torch.where(finite, tokens, -1).tolist()  # the sampler's one sync
    results = [SampleResult(t, None, None) for t in token_list]
    if raw is not None:  # two more: the logprobs' ids and values
        for i, (logprob, top) in StepLogprobs(raw, tokens, rows).results(token_list).items():
            results[i].logprob, results[i].top_logprobs = logprob, top
    return results


def argmax_rows(layout: list, drawn: bool = False) -> list | None:
    """Of a step's ``LogitsRows``: the entries that sample a token, if there are some
    and each takes the raw argmax: ``Request.argmax_only`` (greedy; no logprobs, bias,
    penalties, grammar or fork) with its min_tokens generated. None otherwise.
    ``drawn``: or is drawn on the device alone (``Request.device_only``: no grammar;
    min_tokens masked there too), not a fork (a request of n > 1's first token)."""
    sampled = []
    for entry in layout:
        if entry.sample_row is None:
            continue
        seq = entry.item.seq
        request = seq.request
        if not (request.device_only and not request.needs_fork if drawn else request.argmax_only):
            return None
        min_tokens = request.params.min_tokens
        if not drawn and min_tokens and seq.num_output_tokens < min_tokens:
            return None
        sampled.append(entry)
    return sampled or None
