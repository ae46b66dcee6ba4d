"""Jobs on the queue ``{p}:requests``: orjson in a stream entry's field ``data``, with
``"v": 1``. (Chunks, on ``{p}:out:<id>``, are ``lifecycle.chunk``'s.) Decoding
validates everything a worker relies on and raises ValueError naming the problem
(workers dead-letter such entries). Torch-free.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from lorapool.bounds import MAX_REQUEST_ID, MAX_RESULT_TTL_S
from lorapool.messages import check_json_size, check_messages, check_tools, utf8_size
from lorapool.outputs import (
    wire_head,
)
from lorapool.protocol import (
    INT32_MAX,
    WIRE_VERSION,
    FieldError,
    LoRARequest,
    SamplingParams,
    check,
    is_int,
    short_repr,
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
    result_ttl_s: int | None = None  # None: the worker's --result-ttl
    # a chat: [{"role", "content"}, ...]; the worker applies the model's chat template
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # a chat's tools, for its chat template

    @property
    def engine_prompt(self) -> str | dict[str, Any]:
        """What ``LLMEngine.add_request`` takes as its prompt (for a chat, see
        ``lorapool.worker.prompt``)."""
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": self.prompt_token_ids, "prompt": self.prompt}
        return self.prompt

    def to_dict(self) -> dict[str, Any]:
        return {
            **wire_head(self),
            "sampling_params": self.sampling_params.to_dict(),
            "lora_request": None if self.lora_request is None else self.lora_request.to_dict(),
            "metadata": self.metadata,
            "arrival_time": self.arrival_time,
            **{k: v for k in ("result_ttl_s", "messages", "tools") if (v := getattr(self, k))},
        }


def _fail(message: str) -> None:
    raise ValueError(message)


def _loads(
    payload: bytes | str | None, what: str, speaks: int = WIRE_VERSION, implied: Any = None
) -> dict[str, Any]:
    """The record's JSON object, of version ``speaks`` (``implied`` when it names none)."""
    if payload is None:
        _fail(f"malformed {what}: no {DATA!r} field")
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"malformed {what}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        _fail(f"malformed {what}: expected an object, got {type(data).__name__}")
    version = data.get("v", implied)
    if version != speaks:
        _fail(f"unknown wire version {version!r} in {what} (this build speaks {speaks})")
    return data


def encode_job(job: Job) -> bytes:
    return orjson.dumps(job.to_dict())


DEFAULT_MAX_PROMPT_BYTES = 1 << 20
DEFAULT_MAX_N = 128
MAX_METADATA_BYTES = 64 << 10
_JOB_FIELDS = frozenset(
    ("v", "request_id", "prompt", "prompt_token_ids", "sampling_params")
    + ("lora_request", "metadata", "arrival_time", "result_ttl_s", "messages", "tools")
)


@dataclass(frozen=True)
class JobLimits:
    """Sizes a deployment accepts; producers check them at submit, workers at decode.

    max_prompt_bytes: the prompt's UTF-8 text plus 4 bytes per prompt token id.
    max_n: completions per request (each one holds its own KV blocks).
    """

    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    max_n: int = DEFAULT_MAX_N

    def __post_init__(self):
        for name in ("max_prompt_bytes", "max_n"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def decode_job(payload: bytes | str | None, limits: JobLimits | None = None) -> Job:
    """A validated Job from a stream entry's payload; ValueError naming the problem."""
    return job_from_dict(_loads(payload, "job"), limits)


def job_from_dict(data: Any, limits: JobLimits | None = None) -> Job:
    """The one validation boundary of a job: producers (at submit) and workers use it.

    Checks the type and range of every field; raises FieldError (a ValueError)
    naming the field and its value.
    """
    limits = limits or JobLimits()
    if not isinstance(data, dict):
        raise FieldError(f"a job must be an object, got {short_repr(data)}")
    unknown = sorted(map(str, set(data) - _JOB_FIELDS))
    if unknown:
        raise FieldError(f"unknown job field(s): {short_repr(', '.join(unknown))}")
    version = data.get("v", WIRE_VERSION)
    if version != WIRE_VERSION:
        raise FieldError(
            f"unknown wire version {short_repr(version)} in job (this build speaks {WIRE_VERSION})"
        )
    rid = data.get("request_id")
    if not (
        isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID and not _BAD_ID.intersection(rid)
    ):
        raise FieldError(
            f"request_id must be a non-empty string of at most {MAX_REQUEST_ID} characters "
            f"without braces or NUL, got {short_repr(rid)}"
        )
    where = f"job {rid}: "
    try:
        messages = check_messages(data.get("messages"), limits.max_prompt_bytes)
        tools = check_tools(data.get("tools"), limits.max_prompt_bytes, messages is not None)
        prompt, ids = _job_prompt(
            data.get("prompt"), data.get("prompt_token_ids"), limits, messages is not None
        )
        params = data.get("sampling_params")
        sampling = SamplingParams.from_dict({} if params is None else params)
        check(
            sampling.n <= limits.max_n,
            f"sampling_params.n must be at most {limits.max_n} (max_n), got {sampling.n}",
        )
        lora = LoRARequest.from_dict(data.get("lora_request"))
        metadata = _metadata(data.get("metadata"))
        arrival = data.get("arrival_time")
        if arrival is None:
            arrival = time.time()
        if not (
            (is_int(arrival) and 0 <= arrival < 2**53)
            or (isinstance(arrival, float) and math.isfinite(arrival) and arrival >= 0)
        ):
            raise FieldError(
                f"arrival_time must be a finite number >= 0 (seconds), got {short_repr(arrival)}"
            )
        ttl = data.get("result_ttl_s")
        if not (ttl is None or (is_int(ttl) and 1 <= ttl <= MAX_RESULT_TTL_S)):
            raise FieldError(
                f"result_ttl_s must be an integer in [1, {MAX_RESULT_TTL_S}] (seconds), "
                f"got {short_repr(ttl)}"
            )
    except (TypeError, FieldError) as exc:  # TypeError: a constructor given the wrong shape
        raise FieldError(f"{where}{exc}", rid) from None
    return Job(rid, prompt, ids, sampling, lora, metadata, float(arrival), ttl, messages, tools)


_BAD_ID = frozenset("{}\x00")


def _job_prompt(prompt: Any, ids: Any, limits: JobLimits, chat: bool = False) -> tuple:
    if not (prompt is None or isinstance(prompt, str)):
        raise FieldError(f"prompt must be a string, got {short_repr(prompt)}")
    if chat:
        check(
            prompt is None and ids is None,
            "a job has either messages or a prompt (prompt_token_ids), not both",
        )
        return None, None
    if ids is None:
        check(bool(prompt), "the job needs a non-empty prompt, prompt_token_ids or messages")
    else:
        if not (isinstance(ids, list) and len(ids) > 0):
            raise FieldError(
                f"prompt_token_ids must be a non-empty list of token ids, got {short_repr(ids)}"
            )
        for i, token in enumerate(ids):
            if not (is_int(token) and 0 <= token <= INT32_MAX):
                raise FieldError(
                    f"prompt_token_ids[{i}] must be a token id (an integer >= 0), "
                    f"got {short_repr(token)}"
                )
    size = 4 * len(ids or ())
    if prompt:
        size += utf8_size(prompt, "prompt")
    check(
        size <= limits.max_prompt_bytes,
        f"the prompt is {size} bytes, over the limit of {limits.max_prompt_bytes} "
        "(max_prompt_bytes)",
    )
    return prompt, None if ids is None else list(ids)


def _metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise FieldError(f"metadata must be an object, got {short_repr(metadata)}")
    check_json_size(metadata, "metadata", MAX_METADATA_BYTES)
    return metadata
