"""The request-side types of the public API (vLLM's), their checks and their wire form.

Torch-free: producers import these without a GPU stack. Every type converts
to and from plain dicts (``to_dict`` / ``from_dict``) that orjson serializes.
"""

from __future__ import annotations

import enum
import math
import os
import reprlib
from dataclasses import asdict, dataclass, fields
from typing import Any

from lorapool.bounds import (
    INT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_LORA_NAME,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOTAL_CHARS,
    PENALTY_MAX,
    SEED_MAX,
    SEED_MIN,
)

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
    # token id -> bias added to its logit, in [-100, 100] (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # the grammar the completions must follow (lorapool.structured, vLLM's field)
    structured_outputs: Any = None

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """Normalize and check every field: FieldError (a ValueError) naming the bad one.

        Runs at construction; producers run it again before they enqueue, so a
        field changed after construction is checked too.
        """
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not (self.stop is None or isinstance(self.stop, (list, tuple))):
            raise FieldError(
                "sampling_params.stop must be a string or a list of strings, "
                f"got {short_repr(self.stop)}"
            )
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple))):
            raise FieldError(
                "sampling_params.stop_token_ids must be a list of token ids, "
                f"got {short_repr(self.stop_token_ids)}"
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
        if self.logit_bias is not None:
            self.logit_bias = check_logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            from lorapool.structured import StructuredOutputsParams

            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

    def _verify(self) -> None:
        _int_field("n", self.n, lo=1)
        _real_field("temperature", self.temperature, lo=0.0)
        _real_field("top_p", self.top_p, lo=0.0, hi=1.0)
        check(self.top_p > 0.0, "sampling_params.top_p must be in (0, 1], got 0.0")
        _int_field("top_k", self.top_k, lo=-1)
        check(self.top_k != 0, "sampling_params.top_k must be -1 (disabled) or at least 1, got 0")
        _real_field("min_p", self.min_p, lo=0.0, hi=1.0)
        _int_field("seed", self.seed, lo=SEED_MIN, hi=SEED_MAX, optional=True)
        _real_field("presence_penalty", self.presence_penalty, lo=-PENALTY_MAX, hi=PENALTY_MAX)
        _real_field("frequency_penalty", self.frequency_penalty, lo=-PENALTY_MAX, hi=PENALTY_MAX)
        _real_field("repetition_penalty", self.repetition_penalty, lo=0.0)
        check(
            self.repetition_penalty > 0.0,
            f"sampling_params.repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _int_field("max_tokens", self.max_tokens, lo=1, optional=True)
        _int_field("min_tokens", self.min_tokens, lo=0)
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"sampling_params.min_tokens ({self.min_tokens}) must not exceed "
            f"max_tokens ({self.max_tokens})",
        )
        for name in ("logprobs", "prompt_logprobs"):
            _int_field(name, getattr(self, name), lo=0, optional=True)
        for name in _BOOL_FIELDS:
            if not isinstance(value := getattr(self, name), bool):
                raise FieldError(
                    f"sampling_params.{name} must be true or false, got {short_repr(value)}"
                )
        check_stop(self.stop)
        for i, token in enumerate(self.stop_token_ids):
            _int_field(f"stop_token_ids[{i}]", token, lo=0, hi=INT32_MAX)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["output_kind"] = self.output_kind.value
        if self.logit_bias is not None:  # JSON object keys are strings
            data["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        if self.structured_outputs is not None:
            data["structured_outputs"] = self.structured_outputs.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        return cls(**_fields_of(cls, data, "sampling_params", "sampling parameter(s)"))


def check_stop(stop: list) -> None:
    """FieldError naming ``sampling_params.stop`` and the bound it passes: at most
    MAX_STOP non-empty strings of at most MAX_STOP_CHARS characters, MAX_STOP_TOTAL_CHARS
    in all."""
    if len(stop) > MAX_STOP:
        raise FieldError(
            f"sampling_params.stop must hold at most {MAX_STOP} strings, got {len(stop)}"
        )
    total = 0
    for i, one in enumerate(stop):
        if not isinstance(one, str) or one == "":
            raise FieldError(
                f"sampling_params.stop[{i}] must be a non-empty string, got {short_repr(one)}"
            )
        if len(one) > MAX_STOP_CHARS:
            raise FieldError(
                f"sampling_params.stop[{i}] must be at most {MAX_STOP_CHARS} characters, "
                f"got {len(one)}"
            )
        total += len(one)
    if total > MAX_STOP_TOTAL_CHARS:
        raise FieldError(
            f"sampling_params.stop must hold at most {MAX_STOP_TOTAL_CHARS} characters in "
            f"all, got {total}"
        )


def check_logit_bias(bias: Any) -> dict[int, float]:
    """``{token id: bias}`` with ids as ints (JSON gives them as strings) and biases
    finite numbers in [-100, 100]; FieldError naming the bad entry."""
    if not (isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS):
        raise FieldError(
            f"sampling_params.logit_bias must be an object of at most {MAX_LOGIT_BIAS} "
            f"token ids to biases, got {short_repr(bias)}"
        )
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not (is_int(token) and 0 <= token <= INT32_MAX):
            raise FieldError(
                f"sampling_params.logit_bias keys must be token ids, got {short_repr(key)}"
            )
        _real_field(f"logit_bias[{token}]", value, lo=-100.0, hi=100.0)
        out[token] = float(value)
    return out


class FieldError(ValueError):
    """A field of a job of the wrong type or out of range; the message names it and its value.
    ``request_id``: the job's, once the job boundary knows it (the message then starts
    ``job <request_id>: ``), so a caller of many jobs tells which one without reading it."""

    def __init__(self, message: str, request_id: str = ""):
        super().__init__(message)
        self.request_id = request_id


_BOOL_FIELDS = (
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


def check(ok: bool, message: str) -> None:
    if not ok:
        raise FieldError(message)


_SHORT = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 80, 80, 80
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 8


def _fields_of(cls: type, data: Any, what: str, names: str) -> dict[str, Any]:
    """``data``, checked to be an object of dataclass ``cls``'s fields only."""
    if not isinstance(data, dict):
        raise FieldError(f"{what} must be an object, got {short_repr(data)}")
    unknown = sorted(map(str, set(data) - {f.name for f in fields(cls)}))
    if unknown:
        raise FieldError(f"unknown {names}: {short_repr(', '.join(unknown))}")
    return data


def short_repr(value: Any, limit: int = 60) -> str:
    """A value for an error message: its repr, cut short (prompts can be megabytes, so
    only the first few items of a container or characters of a string are looked at)."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__})"


def is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON true is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


# The checks every job meets raise with a message built only when they fail: a
# worker validates each job it reads, and the messages cost more than the checks.


def _int_field(name: str, value: Any, lo: int, hi: int | None = None, optional=False) -> None:
    if value is None and optional:
        return
    if not is_int(value):
        raise FieldError(f"sampling_params.{name} must be an integer, got {short_repr(value)}")
    if value < lo or (hi is not None and value > hi):
        within = f"at least {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise FieldError(f"sampling_params.{name} must be {within}, got {value}")


def _real_field(name: str, value: Any, lo: float, hi: float | None = None) -> None:
    if not (
        (is_int(value) and abs(value) <= 2**53)
        or (isinstance(value, float) and math.isfinite(value))
    ):
        raise FieldError(f"sampling_params.{name} must be a finite number, got {short_repr(value)}")
    if value < lo or (hi is not None and value > hi):
        within = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise FieldError(f"sampling_params.{name} must be {within}, got {value}")


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
        if not (isinstance(name, str) and 0 < len(name) <= MAX_LORA_NAME and "\x00" not in name):
            raise FieldError(
                f"lora_request.lora_name must be a non-empty string of at most {MAX_LORA_NAME} "
                f"characters without NUL, got {short_repr(name)}"
            )
        if not (is_int(self.lora_int_id) and 1 <= self.lora_int_id <= INT32_MAX):
            raise FieldError(
                f"LoRARequest {name!r}: lora_request.lora_int_id must be an int in "
                f"[1, {INT32_MAX}], got {short_repr(self.lora_int_id)}"
            )
        if isinstance(self.lora_path, os.PathLike):
            self.lora_path = os.fspath(self.lora_path)
        if not (isinstance(self.lora_path, str) and "\x00" not in self.lora_path):
            raise FieldError(
                "lora_request.lora_path must be a string without NUL, "
                f"got {short_repr(self.lora_path)}"
            )
        if not (self.base_model_name is None or isinstance(self.base_model_name, str)):
            raise FieldError(
                "lora_request.base_model_name must be a string, "
                f"got {short_repr(self.base_model_name)}"
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
        _fields_of(cls, data, "lora_request", "lora_request field(s)")
        missing = [k for k in ("lora_name", "lora_int_id") if k not in data]
        check(not missing, f"lora_request needs {' and '.join(missing)}")
        return cls(**data)


__all__ = [
    "FINISH_REASONS",
    "FieldError",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_STOP_TOTAL_CHARS",
    "WIRE_VERSION",
    "LoRARequest",
    "RequestOutputKind",
    "SamplingParams",
]
