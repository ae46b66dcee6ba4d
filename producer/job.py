"""Pieces shared by the sync and async producers: building jobs and assembling outputs."""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Mapping
from typing import Any

from lorapool.protocol import LoRARequest, RequestOutput, RequestOutputKind, SamplingParams
from lorapool.wire import Chunk, Job

# Enqueue a job only if its request id is new: the marker and the entry together.
# KEYS: job marker, requests stream. ARGV: payload, output kind, now.
SUBMIT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local entry = redis.call('XADD', KEYS[2], '*', 'data', ARGV[1])
redis.call('HSET', KEYS[1], 'status', 'queued', 'entry', entry,
           'output_kind', ARGV[2], 'submitted', ARGV[3])
return entry
"""


def build_job(
    prompt: Any,
    params: SamplingParams | None,
    lora: LoRARequest | None,
    request_id: str | None,
    metadata: dict | None,
) -> Job:
    """A validated Job; ValueError naming the problem."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    params = SamplingParams.from_dict(params.to_dict())  # re-validates after any mutation
    if request_id is not None and (
        not isinstance(request_id, str) or not request_id or any(c in request_id for c in "{}")
    ):
        raise ValueError(
            f"request_id must be a non-empty string without braces, got {request_id!r}"
        )
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    text, ids = _prompt(prompt)
    return Job(
        request_id or uuid.uuid4().hex, text, ids, params, lora, dict(metadata or {}), time.time()
    )


def _prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt, None
    if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if (
            not isinstance(ids, (list, tuple))
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        return prompt.get("prompt"), list(ids)
    if isinstance(prompt, Mapping) and "prompt" in prompt:
        return _prompt(prompt["prompt"])
    raise ValueError(
        f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
    )


def per_prompt(value: Any, count: int, what: str) -> list:
    """``value`` repeated, or the list of one per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{len(value)} {what} for {count} prompts")
        return value
    return [value] * count


class OutputAssembler:
    """Turns delta chunks into the RequestOutputs of one ``output_kind``."""

    def __init__(self, kind: RequestOutputKind | str):
        self.kind = RequestOutputKind(kind)
        self.total: RequestOutput | None = None
        self.lora: LoRARequest | None = None
        self.prompt: tuple = (None, None)

    def feed(self, chunk: Chunk) -> RequestOutput | None:
        """The output to yield for this chunk, or None (FINAL_ONLY before the end)."""
        delta = chunk.to_output()
        self._fill(delta, chunk)
        if self.total is None:
            self.total = copy.deepcopy(delta)
        else:
            self.total.add(copy.deepcopy(delta), aggregate=True)
        if self.kind == RequestOutputKind.DELTA:
            return delta
        if self.kind == RequestOutputKind.FINAL_ONLY and not chunk.finished:
            return None
        return copy.deepcopy(self.total)

    def _fill(self, delta: RequestOutput, chunk: Chunk) -> None:
        """Carry the full adapter and the prompt of the first chunk into every output."""
        if chunk.lora_request is not None:
            self.lora = delta.lora_request
        if chunk.prompt_token_ids is not None:
            self.prompt = (chunk.prompt, chunk.prompt_token_ids)
        delta.lora_request = self.lora
        delta.prompt, delta.prompt_token_ids = self.prompt
        for c in delta.outputs:
            c.lora_request = self.lora
