"""The data types of the public API, mirroring vLLM's, and their wire form.

Torch-free: producers import these without a GPU stack. Every type converts
to and from plain dicts (``to_dict`` / ``from_dict``) that orjson serializes.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

WIRE_VERSION = 1
FINISH_REASONS = ("stop", "length", "abort", "error")
_GREEDY_EPS = 1e-5


class RequestOutputKind(str, enum.Enum):
    """What each streamed RequestOutput holds."""

    CUMULATIVE = "cumulative"  # everything so far
    DELTA = "delta"  # only what is new since the last output
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample one request's completions (vLLM's fields and defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """Normalize and check every field: FieldError (a ValueError) naming the bad one.

        Runs at construction; producers run it again before they enqueue, so a
        field changed after construction is checked too.
        """
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            self.stop is None or isinstance(self.stop, (list, tuple)),
            "sampling_params.stop must be a string or a list of strings, "
            f"got {short_repr(self.stop)}",
        )
        _check(
            self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
            "sampling_params.stop_token_ids must be a list of token ids, "
            f"got {short_repr(self.stop_token_ids)}",
        )
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            kinds = ", ".join(k.value for k in RequestOutputKind)
            raise FieldError(
                f"sampling_params.output_kind must be one of {kinds}, "
                f"got {short_repr(self.output_kind)}"
            ) from None
        self._verify()

    def _verify(self) -> None:
        _int_field("n", self.n, lo=1)
        _real_field("temperature", self.temperature, lo=0.0)
        _real_field("top_p", self.top_p, lo=0.0, hi=1.0)
        _check(self.top_p > 0.0, "sampling_params.top_p must be in (0, 1], got 0.0")
        _int_field("top_k", self.top_k, lo=-1)
        _check(self.top_k != 0, "sampling_params.top_k must be -1 (disabled) or at least 1, got 0")
        _real_field("min_p", self.min_p, lo=0.0, hi=1.0)
        _int_field("seed", self.seed, lo=SEED_MIN, hi=SEED_MAX, optional=True)
        _real_field("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _real_field("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _real_field("repetition_penalty", self.repetition_penalty, lo=0.0)
        _check(
            self.repetition_penalty > 0.0,
            f"sampling_params.repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _int_field("max_tokens", self.max_tokens, lo=1, optional=True)
        _int_field("min_tokens", self.min_tokens, lo=0)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"sampling_params.min_tokens ({self.min_tokens}) must not exceed "
            f"max_tokens ({self.max_tokens})",
        )
        for name in ("logprobs", "prompt_logprobs"):
            _int_field(name, getattr(self, name), lo=0, optional=True)
        for name in _BOOL_FIELDS:
            _check(
                isinstance(getattr(self, name), bool),
                f"sampling_params.{name} must be true or false, "
                f"got {short_repr(getattr(self, name))}",
            )
        for i, stop in enumerate(self.stop):
            _check(
                isinstance(stop, str) and stop != "",
                f"sampling_params.stop[{i}] must be a non-empty string, got {short_repr(stop)}",
            )
        for i, token in enumerate(self.stop_token_ids):
            _int_field(f"stop_token_ids[{i}]", token, lo=0, hi=INT32_MAX)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["output_kind"] = self.output_kind.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        _check(
            isinstance(data, dict),
            f"sampling_params must be an object, got {short_repr(data)}",
        )
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(data) - known))
        _check(not unknown, f"unknown sampling parameter(s): {short_repr(', '.join(unknown))}")
        return cls(**data)


class FieldError(ValueError):
    """A field of a job of the wrong type or out of range; the message names it and its value."""


MAX_LORA_NAME = 1024
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
INT32_MAX = 2**31 - 1
_BOOL_FIELDS = (
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise FieldError(message)


def short_repr(value: Any, limit: int = 60) -> str:
    """A value for an error message: its repr, cut short (prompts can be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__})"


def is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON true is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(name: str, value: Any, lo: int, hi: int | None = None, optional=False) -> None:
    if value is None and optional:
        return
    _check(is_int(value), f"sampling_params.{name} must be an integer, got {short_repr(value)}")
    _check(
        value >= lo and (hi is None or value <= hi),
        f"sampling_params.{name} must be "
        + (f"at least {lo}" if hi is None else f"in [{lo}, {hi}]")
        + f", got {value}",
    )


def _real_field(name: str, value: Any, lo: float, hi: float | None = None) -> None:
    _check(
        (is_int(value) and abs(value) <= 2**53)
        or (isinstance(value, float) and math.isfinite(value)),
        f"sampling_params.{name} must be a finite number, got {short_repr(value)}",
    )
    _check(
        value >= lo and (hi is None or value <= hi),
        f"sampling_params.{name} must be "
        + (f">= {lo}" if hi is None else f"in [{lo}, {hi}]")
        + f", got {value}",
    )


@dataclass(eq=False)
class LoRARequest:
    """Which adapter a request runs with. Equal and hashed by adapter id."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """FieldError (a ValueError) naming the field when one has the wrong type or range."""
        name = self.lora_name
        _check(
            isinstance(name, str) and 0 < len(name) <= MAX_LORA_NAME and "\x00" not in name,
            f"lora_request.lora_name must be a non-empty string of at most {MAX_LORA_NAME} "
            f"characters without NUL, got {short_repr(name)}",
        )
        _check(
            is_int(self.lora_int_id) and 1 <= self.lora_int_id <= INT32_MAX,
            f"LoRARequest {name!r}: lora_request.lora_int_id must be an int in [1, {INT32_MAX}], "
            f"got {short_repr(self.lora_int_id)}",
        )
        if isinstance(self.lora_path, os.PathLike):
            self.lora_path = os.fspath(self.lora_path)
        _check(
            isinstance(self.lora_path, str) and "\x00" not in self.lora_path,
            "lora_request.lora_path must be a string without NUL, "
            f"got {short_repr(self.lora_path)}",
        )
        _check(
            self.base_model_name is None or isinstance(self.base_model_name, str),
            "lora_request.base_model_name must be a string, "
            f"got {short_repr(self.base_model_name)}",
        )

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_int_id == other.lora_int_id

    def __hash__(self) -> int:
        return hash(self.lora_int_id)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> LoRARequest | None:
        if data is None:
            return None
        _check(isinstance(data, dict), f"lora_request must be an object, got {short_repr(data)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(data) - known))
        _check(not unknown, f"unknown lora_request field(s): {short_repr(', '.join(unknown))}")
        missing = [k for k in ("lora_name", "lora_int_id") if k not in data]
        _check(not missing, f"lora_request needs {' and '.join(missing)}")
        return cls(**data)


@dataclass
class Logprob:
    """The log-probability of one token, its rank in the vocabulary and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


def logprobs_to_wire(logprobs: list[dict[int, Logprob] | None] | None) -> list | None:
    """Dicts keyed by int do not fit JSON objects: [[token, logprob, rank, text], ...]."""
    if logprobs is None:
        return None
    return [
        None
        if pos is None
        else [[t, lp.logprob, lp.rank, lp.decoded_token] for t, lp in pos.items()]
        for pos in logprobs
    ]


def logprobs_from_wire(data: list | None) -> list[dict[int, Logprob] | None] | None:
    if data is None:
        return None
    return [
        None if pos is None else {t: Logprob(lp, rank, text) for t, lp, rank, text in pos}
        for pos in data
    ]


@dataclass
class CompletionOutput:
    """One completion of a request (there are ``n`` of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self, with_lora: bool = True) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "cumulative_logprob": self.cumulative_logprob,
            "logprobs": logprobs_to_wire(self.logprobs),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            **({"lora_request": _lora_dict(self.lora_request)} if with_lora else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], lora_request: LoRARequest | None = None):
        lora = LoRARequest.from_dict(data["lora_request"]) if "lora_request" in data else None
        return cls(
            index=data["index"],
            text=data["text"],
            token_ids=list(data["token_ids"]),
            cumulative_logprob=data.get("cumulative_logprob"),
            logprobs=logprobs_from_wire(data.get("logprobs")),
            finish_reason=data.get("finish_reason"),
            stop_reason=data.get("stop_reason"),
            lora_request=lora_request if lora_request is not None else lora,
        )


def _lora_dict(lora: LoRARequest | None) -> dict[str, Any] | None:
    return None if lora is None else lora.to_dict()


@dataclass
class RequestMetrics:
    """Timestamps (``time.time()`` seconds) and token counts of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return self.time_in_queue

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RequestMetrics | None:
        return None if data is None else cls(**data)


class RequestOutput:
    """The output of one request: its prompt, completions, adapter and metrics."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: PromptLogprobs | None,
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: RequestMetrics | None = None,
        lora_request: LoRARequest | None = None,
        encoder_prompt: str | None = None,
        encoder_prompt_token_ids: list[int] | None = None,
        num_cached_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.error: str | None = kwargs.pop("error", None)
        self.worker: str | None = kwargs.pop("worker", None)

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one.

        aggregate=True appends text, token ids and logprobs and takes the later
        cumulative_logprob, finish_reason and stop_reason; aggregate=False
        replaces the completion with the same index. Unknown indices are appended.
        """
        self.finished |= next_output.finished
        for key in ("metrics", "error", "worker", "num_cached_tokens", "prompt_logprobs"):
            if getattr(next_output, key) is not None:
                setattr(self, key, getattr(next_output, key))
        for nxt in next_output.outputs:
            position = next((i for i, c in enumerate(self.outputs) if c.index == nxt.index), None)
            if position is None:
                self.outputs.append(nxt)
            elif not aggregate:
                self.outputs[position] = nxt
            else:
                _append_completion(self.outputs[position], nxt)

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": WIRE_VERSION,
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "prompt_logprobs": logprobs_to_wire(self.prompt_logprobs),
            "outputs": [c.to_dict(with_lora=False) for c in self.outputs],
            "finished": self.finished,
            "metrics": None if self.metrics is None else self.metrics.to_dict(),
            "lora_request": _lora_dict(self.lora_request),
            "num_cached_tokens": self.num_cached_tokens,
            "error": self.error,
            "worker": self.worker,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestOutput:
        version = data.get("v", WIRE_VERSION)
        _check(version == WIRE_VERSION, f"unknown wire version {version!r}")
        lora = LoRARequest.from_dict(data.get("lora_request"))
        return cls(
            request_id=data["request_id"],
            prompt=data.get("prompt"),
            prompt_token_ids=data.get("prompt_token_ids"),
            prompt_logprobs=logprobs_from_wire(data.get("prompt_logprobs")),
            outputs=[CompletionOutput.from_dict(c, lora) for c in data["outputs"]],
            finished=data["finished"],
            metrics=RequestMetrics.from_dict(data.get("metrics")),
            lora_request=lora,
            num_cached_tokens=data.get("num_cached_tokens"),
            error=data.get("error"),
            worker=data.get("worker"),
        )

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"outputs={self.outputs!r}, finished={self.finished}, "
            f"lora_request={self.lora_request!r}, metrics={self.metrics!r})"
        )


def _append_completion(mine: CompletionOutput, nxt: CompletionOutput) -> None:
    mine.text += nxt.text
    mine.token_ids = list(mine.token_ids) + list(nxt.token_ids)
    if nxt.logprobs is not None:
        mine.logprobs = (mine.logprobs or []) + list(nxt.logprobs)
    mine.cumulative_logprob = nxt.cumulative_logprob
    mine.finish_reason = nxt.finish_reason
    mine.stop_reason = nxt.stop_reason
    if nxt.lora_request is not None:
        mine.lora_request = nxt.lora_request


__all__ = [
    "FINISH_REASONS",
    "FieldError",
    "WIRE_VERSION",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "PromptLogprobs",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SampleLogprobs",
    "SamplingParams",
]
