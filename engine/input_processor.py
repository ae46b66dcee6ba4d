"""Validates and tokenizes what add_request receives, before anything is queued."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lorapool.engine.sequence import Request
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.records.errors import FieldError


@dataclass
class InputLimits:
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    max_logprobs: int
    enable_lora: bool


@dataclass(frozen=True)
class InputProcessor:
    """Turns what add_request receives into a Request within the engine's limits."""

    tokenizer: Any  # a transformers tokenizer: encode(text, add_special_tokens=...)
    limits: InputLimits

    def process(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None,
        lora_request: LoRARequest | None,
        arrival_time: float | None,
        resume_token_ids: list[int] | None = None,
    ) -> Request:
        """A validated Request; raises ValueError naming the problem."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"request {request_id}: params must be SamplingParams, got {type(params).__name__}"
            )
        self._check_params(request_id, params)
        self._check_lora(request_id, lora_request)
        text, token_ids = self._tokenize(request_id, prompt)
        max_tokens = self._max_tokens(request_id, params, len(token_ids))
        resumed = self._check_resume(request_id, params, resume_token_ids, max_tokens)
        return Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            lora_request=lora_request,
            arrival_time=arrival_time or time.time(),
            max_tokens=max_tokens,
            resumed_token_ids=resumed,
        )

    def _check_resume(
        self, request_id: str, params: SamplingParams, token_ids: list[int] | None, max_tokens: int
    ) -> list[int]:
        if not token_ids:
            return []
        if params.n != 1:
            raise FieldError(
                f"request {request_id}: only n=1 requests can resume, n={params.n}",
                field="sampling_params.n",
            )
        self._check_token_ids(request_id, list(token_ids))
        if len(token_ids) >= max_tokens:
            raise FieldError(
                f"request {request_id}: {len(token_ids)} resumed tokens leave none "
                f"of max_tokens={max_tokens} to generate",
                field="sampling_params.max_tokens",
            )
        return list(token_ids)

    def _check_params(self, request_id: str, params: SamplingParams) -> None:
        limit = self.limits.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise FieldError(
                    f"request {request_id}: {name}={value} exceeds the limit max_logprobs={limit}",
                    field=f"sampling_params.{name}",
                )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise FieldError(
                f"request {request_id}: stop_token_ids {bad} outside the "
                f"vocabulary of {self.limits.vocab_size} tokens",
                field="sampling_params.stop_token_ids",
            )

    def _check_lora(self, request_id: str, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"request {request_id}: lora_request must be a LoRARequest, "
                f"got {type(lora_request).__name__}"
            )
        if not self.limits.enable_lora:
            raise FieldError(
                f"request {request_id}: adapter {lora_request.name!r} given but "
                f"the engine was started without enable_lora=True",
                field="adapter",
            )

    def _tokenize(self, request_id: str, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            self._check_token_ids(request_id, token_ids)
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            return self._tokenize(request_id, prompt["prompt"])
        else:
            raise FieldError(
                f"request {request_id}: prompt must be a string or "
                f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}",
                field="prompt",
            )
        if not token_ids:
            raise FieldError(f"request {request_id}: the prompt is empty", field="prompt")
        return text, token_ids

    def _check_token_ids(self, request_id: str, token_ids: list) -> None:
        vocab = self.limits.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise FieldError(
                f"request {request_id}: prompt token ids {bad[:5]} are not in "
                f"the vocabulary of {vocab} tokens",
                field="prompt",
            )

    def _max_tokens(self, request_id: str, params: SamplingParams, prompt_len: int) -> int:
        max_len = self.limits.max_model_len
        if prompt_len >= max_len:
            raise FieldError(
                f"request {request_id}: the prompt has {prompt_len} tokens; the "
                f"model's context is {max_len}, which leaves no room to generate",
                field="prompt",
            )
        room = max_len - prompt_len
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        needed = prompt_len + max_tokens
        capacity = self.limits.kv_capacity_tokens
        if needed > capacity:
            raise FieldError(
                f"request {request_id}: {prompt_len} prompt tokens + {max_tokens} "
                f"max_tokens need {needed} KV cache slots; the cache holds only "
                f"{capacity} (raise kv_cache_memory or lower max_tokens)",
                field="prompt",
            )
        n = max(1, params.n)
        # n sequences share the prompt's slots and each needs its own max_tokens: at
        # least this many at once (issue 31 row D: n=128, max_tokens=2000 on a cache of
        # 364 blocks was admitted, ran 4.5 min for 6% of its tokens and held the worker)
        together = prompt_len + n * max_tokens
        if n > 1 and together > capacity:
            raise FieldError(
                f"request {request_id}: n={n} sequences of up to {max_tokens} tokens "
                f"after a {prompt_len}-token prompt need at least {together} KV cache "
                f"slots together; the cache holds only {capacity} (lower n or max_tokens, "
                "or raise kv_cache_memory)",
                field="sampling_params.n",
            )
        return max_tokens
