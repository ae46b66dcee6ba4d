"""Limits a worker holds a request to, checked at the door: a 400 naming the request's
parameter instead of a job that fails on its worker (or runs far past what was meant).

Workers publish their bounds in their heartbeat (``max_model_len``, ``max_logprobs``,
``kv_capacity_tokens``);
the gateway takes the smallest over the live workers of the base model, read at most
every ``REFRESH_S``. With no live worker the bounds are unknown, and the worker checks
(its error then names the parameter too: ``errors.failed_request``). A text prompt's
tokens are counted by the worker's tokenizer; here it counts as at least one token
(token-id prompts count exactly), so ``max_tokens`` of at least the whole context is
refused here, and any prompt the worker finds too long comes back as a 400 on ``prompt``.
A request of n > 1 sequences whose n sequences cannot fit in the KV cache together (the
prompt's slots once, then ``max_tokens`` each: the worker's own rule, issue 31 Build 4)
is a 400 on ``n``, judged on the smallest cache of the live workers and, for a prompt
whose tokens are not counted here, on the fewest tokens it can have.
The seed takes what vLLM's API takes (a signed 64-bit integer: ``bodies.Int64``).
Stop strings: at most the gateway's ``max_stop`` (OpenAI's 4 by default), each string's
and all their characters bounded by ``SamplingParams`` itself (``protocol.MAX_STOP_CHARS``,
``MAX_STOP_TOTAL_CHARS``; Python producers meet the same bounds, with ``MAX_STOP`` strings).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lorapool.openai.errors import APIError, bad_request
from lorapool.records.heartbeat import Heartbeat

REFRESH_S = 5.0


@dataclass(frozen=True)
class PoolLimits:
    max_model_len: int | None = None
    max_logprobs: int | None = None
    kv_capacity_tokens: int | None = None


def pool_limits(workers: list[Heartbeat], model: str | None) -> PoolLimits:
    """The tightest bounds of the live workers that serve ``model`` (a worker that says
    none: no bound of its own)."""
    serving = [w for w in workers if w.model == model and not w.draining]

    def least(values) -> int | None:
        values = [v for v in values if v is not None]
        return min(values) if values else None

    return PoolLimits(
        least(w.max_model_len for w in serving),
        least(w.max_logprobs for w in serving),
        least(w.kv_capacity_tokens for w in serving),
    )


class LimitsCache:
    """The pool's limits, read from the heartbeats at most every ``REFRESH_S``."""

    def __init__(self):
        self.limits, self.read_at = PoolLimits(), -REFRESH_S

    async def get(self, pool) -> PoolLimits:
        """Of ``pool``'s ``live_workers()`` that serve its ``base_model()``."""
        if time.monotonic() - self.read_at >= REFRESH_S:
            base = await pool.base_model()
            workers = await pool.live_workers()
            self.limits = pool_limits(workers, base.name if base else None)
            self.read_at = time.monotonic()
        return self.limits


def check_stop_count(parsed, max_stop: int) -> None:
    """400 on ``stop`` when the request names more than ``max_stop`` stop strings."""
    count = len(parsed.params.stop)
    if count > max_stop:
        raise bad_request(
            f"stop must hold at most {max_stop} strings (the gateway's max_stop), got {count}",
            "stop",
        )


def check_limits(parsed, limits: PoolLimits) -> None:
    """400 naming the parameter of ``parsed`` (a ``params.Parsed``) that passes a bound."""
    names, params = parsed.names, parsed.params
    top = params.logprobs
    if limits.max_logprobs is not None and top is not None and top > limits.max_logprobs:
        name = names.get("logprobs", "logprobs")
        raise bad_request(f"{name} must be at most {limits.max_logprobs}, got {top}", name)
    context = limits.max_model_len
    if context is None:
        return
    for prompt in parsed.prompts:
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        known = len(ids) if isinstance(ids, list) else 1
        if isinstance(ids, list) and known >= context:
            raise bad_request(
                f"the prompt has {known} tokens; the pool's context is {context} tokens, "
                "which leaves none to generate",
                "prompt",
            )
        if params.max_tokens is not None and known + params.max_tokens > context:
            raise _over_context(params.max_tokens, known, context, names)
        _check_together(params, known, isinstance(ids, list), context, limits, names)


def _check_together(params, known: int, exact: bool, context: int, limits, names) -> None:
    """400 on ``n`` when the request's n sequences cannot fit in the smallest worker's
    KV cache together: the prompt's ``p`` slots, then ``min(max_tokens, context - p)``
    each (``InputProcessor._max_tokens``). A prompt of ``known`` tokens or more
    (``exact``: just ``known``) needs at least the least of that over its possible
    lengths, which lies at an end of them (it rises, then falls)."""
    capacity, n = limits.kv_capacity_tokens, max(1, params.n)
    if capacity is None or n == 1:
        return

    def together(p: int) -> int:
        room = context - p
        return p + n * (room if params.max_tokens is None else min(params.max_tokens, room))

    least = together(known) if exact else min(together(known), together(context - 1))
    if least > capacity:
        name = names.get("n", "n")
        raise bad_request(
            f"{name}={n} sequences after a prompt of {known if exact else 'at least 1'} "
            f"token{'s' if exact and known != 1 else ''} need at least {least} KV cache "
            f"slots together; the pool's workers hold {capacity} (lower {name} or "
            "max_tokens)",
            name,
        )


def _over_context(max_tokens: int, known: int, context: int, names: dict) -> APIError:
    name = names.get("max_tokens", "max_tokens")
    counted = f"{known} prompt tokens" if known > 1 else "the prompt (at least 1 token)"
    return bad_request(
        f"{name}={max_tokens} and {counted} exceed the pool's context of {context} tokens",
        name,
    )
