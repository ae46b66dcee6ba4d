"""Wire records on the queue: jobs on ``{p}:requests`` and chunks on ``{p}:out:<id>``.

Both are orjson in a stream entry's field ``data`` with ``"v": 1``. Decoding
validates everything a worker or a client relies on and raises ValueError
naming the problem (workers dead-letter such entries). Torch-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from lorapool.protocol import (
    WIRE_VERSION,
    CompletionOutput,
    LoRARequest,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    logprobs_from_wire,
    logprobs_to_wire,
)

DATA = "data"  # the stream entry field holding the record


@dataclass
class Job:
    """One generation job as producers enqueue it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    sampling_params: SamplingParams
    lora_request: LoRARequest | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    arrival_time: float = field(default_factory=time.time)

    @property
    def engine_prompt(self) -> str | dict[str, Any]:
        """What ``LLMEngine.add_request`` takes as its prompt."""
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": self.prompt_token_ids, "prompt": self.prompt}
        return self.prompt

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": WIRE_VERSION,
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "sampling_params": self.sampling_params.to_dict(),
            "lora_request": None if self.lora_request is None else self.lora_request.to_dict(),
            "metadata": self.metadata,
            "arrival_time": self.arrival_time,
        }


def _fail(message: str) -> None:
    raise ValueError(message)


def _loads(payload: bytes | str | None, what: str) -> dict[str, Any]:
    if payload is None:
        _fail(f"malformed {what}: no {DATA!r} field")
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"malformed {what}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        _fail(f"malformed {what}: expected an object, got {type(data).__name__}")
    version = data.get("v")
    if version != WIRE_VERSION:
        _fail(f"unknown wire version {version!r} in {what} (this build speaks {WIRE_VERSION})")
    return data


def encode_job(job: Job) -> bytes:
    return orjson.dumps(job.to_dict())


def decode_job(payload: bytes | str | None) -> Job:
    """A validated Job; ValueError naming the problem when malformed."""
    data = _loads(payload, "job")
    rid = data.get("request_id")
    if not isinstance(rid, str) or not rid:
        _fail("malformed job: request_id must be a non-empty string")
    prompt, ids = data.get("prompt"), data.get("prompt_token_ids")
    if ids is None and not isinstance(prompt, str):
        _fail(f"malformed job {rid}: needs prompt (a string) or prompt_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(t) for t in ids)):
        _fail(f"malformed job {rid}: prompt_token_ids must be a list of integers")
    params = data.get("sampling_params") or {}
    if not isinstance(params, dict):
        _fail(f"malformed job {rid}: sampling_params must be an object")
    try:
        sampling = SamplingParams.from_dict(params)
        lora = LoRARequest.from_dict(data.get("lora_request"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid job {rid}: {exc}") from None
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        _fail(f"malformed job {rid}: metadata must be an object")
    arrival = data.get("arrival_time") or time.time()
    return Job(rid, prompt, ids, sampling, lora, metadata, float(arrival))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Chunk:
    """One delta of a request's output: what the chunk log holds per step."""

    request_id: str
    seq: int  # 0, 1, 2, ... per request, continuing across failover
    offset: int  # tokens of all completions emitted before this chunk
    outputs: list[dict[str, Any]]  # per completion: index, offset, text, token_ids, ...
    finished: bool = False
    lora_request: dict[str, Any] | None = None  # full on first and final chunk
    adapter_id: int = 0  # 0 = base model
    metrics: dict[str, Any] | None = None
    worker: str | None = None
    error: str | None = None
    prompt: str | None = None  # first chunk only
    prompt_token_ids: list[int] | None = None  # first chunk only

    @property
    def num_tokens(self) -> int:
        return sum(len(o["token_ids"]) for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        data = {"v": WIRE_VERSION, **self.__dict__}
        return {k: v for k, v in data.items() if v is not None}

    def to_output(self) -> RequestOutput:
        """This chunk as a delta RequestOutput (completion texts and tokens are deltas)."""
        lora = LoRARequest.from_dict(self.lora_request)
        outs = [
            CompletionOutput(
                o["index"],
                o["text"],
                list(o["token_ids"]),
                o.get("cumulative_logprob"),
                logprobs_from_wire(o.get("logprobs")),
                o.get("finish_reason"),
                o.get("stop_reason"),
                lora,
            )
            for o in self.outputs
        ]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            None,
            outs,
            self.finished,
            RequestMetrics.from_dict(self.metrics),
            lora,
            error=self.error,
            worker=self.worker,
        )


def completion_wire(c: CompletionOutput, offset: int) -> dict[str, Any]:
    """One completion's delta as it goes into a chunk."""
    return {
        "index": c.index,
        "offset": offset,
        "text": c.text,
        "token_ids": list(c.token_ids),
        "cumulative_logprob": c.cumulative_logprob,
        "logprobs": logprobs_to_wire(c.logprobs),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


def encode_chunk(chunk: Chunk) -> bytes:
    return orjson.dumps(chunk.to_dict())


def decode_chunk(payload: bytes | str | None) -> Chunk:
    """A validated Chunk; ValueError naming the problem when malformed."""
    data = _loads(payload, "chunk")
    data.pop("v")
    try:
        chunk = Chunk(**data)
    except TypeError as exc:
        raise ValueError(f"malformed chunk: {exc}") from None
    if not isinstance(chunk.outputs, list) or not all(
        isinstance(o, dict) and "index" in o and "token_ids" in o for o in chunk.outputs
    ):
        _fail(f"malformed chunk {chunk.request_id}#{chunk.seq}: bad outputs")
    return chunk
