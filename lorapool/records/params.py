"""The request-side types of the public API (vLLM's), their checks and their wire form.

Torch-free: producers import these without a GPU stack. Every type converts
to and from plain dicts (``to_dict`` / ``from_dict``) that orjson serializes.
"""

from __future__ import annotations

import enum
import os
from typing import Any

import msgspec

from lorapool.records.bounds import (  # noqa: F401  (INT32_MAX, MAX_*, PENALTY_MAX: importers')
    INT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_LORA_NAME,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOTAL_CHARS,
    PENALTY_MAX,
    SEED_MAX,
    SEED_MIN,
    AdapterId,
    Count,
    LogitBiases,
    LoraName,
    LoraPath,
    MinP,
    NonNegative,
    Penalty,
    RepetitionPenalty,
    Seed,
    StopStrings,
    Temperature,
    TokenId,
    TopK,
    TopP,
)
from lorapool.records.errors import FieldError, check, invalid, short_repr  # noqa: F401

WIRE_VERSION = 1
FINISH_REASONS = ("stop", "length", "abort", "error")
_GREEDY_EPS = 1e-5


class RequestOutputKind(str, enum.Enum):
    """What each streamed RequestOutput holds."""

    CUMULATIVE = "cumulative"  # everything so far
    DELTA = "delta"  # only what is new since the last output
    FINAL_ONLY = "final_only"  # one output, when the request finishes


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    """How to sample one request's completions (vLLM's fields and defaults; like vLLM's,
    a msgspec Struct). Each field's bound is its type (``lorapool.records.bounds``): msgspec
    keeps it when a job is decoded, and ``verify`` when one is built in Python."""

    n: Count = 1
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1  # -1: disabled; 0 refused (``verify``)
    min_p: MinP = 0.0
    seed: Seed | None = None  # at most SEED_MAX (``verify``: past msgspec's int64 bounds)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    max_tokens: Count | None = 16
    min_tokens: NonNegative = 0  # at most max_tokens (``verify``)
    stop: StopStrings | str | None = None  # at most MAX_STOP_TOTAL_CHARS in all (``verify``)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: NonNegative | None = None
    prompt_logprobs: NonNegative | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # token id -> bias added to its logit, in [-100, 100] (OpenAI's logit_bias)
    logit_bias: LogitBiases | None = None
    # the grammar the completions must follow (lorapool.records.structured, vLLM's field)
    structured_outputs: Any = None

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """Normalize and check every field: FieldError (a ValueError) naming the bad one.

        Runs at construction and when a job is decoded; producers run it again before
        they enqueue, so a field changed after construction is checked too.
        """
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not (self.stop is None or isinstance(self.stop, (list, tuple))):
            raise FieldError(
                "sampling_params.stop must be a string or a list of strings, "
                f"got {short_repr(self.stop)}",
                field="sampling_params.stop",
            )
        self.stop = list(self.stop or [])
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.stop_token_ids = self.stop_token_ids or []
        if isinstance(self.output_kind, str) and not isinstance(self.output_kind, enum.Enum):
            self.output_kind = _KINDS.get(self.output_kind, self.output_kind)
        if isinstance(self.logit_bias, dict):  # JSON object keys are strings
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        try:
            checked = msgspec.convert(self, _CheckedSampling, from_attributes=True)
        except msgspec.ValidationError as exc:
            raise invalid(exc, self, SamplingParams, "sampling_params") from None
        if checked.logit_bias is not None:
            self.logit_bias = checked.logit_bias  # biases as floats
        for name in _FLOAT_FIELDS:  # an int for a float field: the float the wire carries
            value = getattr(self, name)
            if value is not None and not isinstance(value, float):
                setattr(self, name, getattr(checked, name))
        self._cross_check()
        if self.structured_outputs is not None:
            from lorapool.records.structured import StructuredOutputsParams

            try:
                self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
            except FieldError as exc:
                exc.field = exc.field or "sampling_params.structured_outputs"
                raise

    def _cross_check(self) -> None:
        """What no one field's type says."""
        if self.top_k == 0:
            raise FieldError(
                "sampling_params.top_k must be -1 (disabled) or at least 1, got 0",
                field="sampling_params.top_k",
            )
        if self.seed is not None and self.seed > SEED_MAX:
            raise FieldError(
                f"sampling_params.seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}",
                field="sampling_params.seed",
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise FieldError(
                f"sampling_params.min_tokens ({self.min_tokens}) must not exceed "
                f"max_tokens ({self.max_tokens})",
                field="sampling_params.min_tokens",
            )
        total = sum(map(len, self.stop))
        if total > MAX_STOP_TOTAL_CHARS:
            raise FieldError(
                f"sampling_params.stop must hold at most {MAX_STOP_TOTAL_CHARS} characters in "
                f"all, got {total}",
                field="sampling_params.stop",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def to_dict(self) -> dict[str, Any]:
        """As the job's JSON holds it: every field, in order."""
        data = msgspec.structs.asdict(self)
        data["output_kind"] = self.output_kind.value
        if self.logit_bias is not None:  # JSON object keys are strings
            data["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        if self.structured_outputs is not None:
            data["structured_outputs"] = self.structured_outputs.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Any) -> SamplingParams:
        try:
            return msgspec.convert(with_token_keys(data), cls)
        except msgspec.ValidationError as exc:
            raise invalid(exc, data, cls, "sampling_params") from None


_KINDS = {k.value: k for k in RequestOutputKind}


def _token_key(key: Any) -> Any:
    return int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key


def with_token_keys(params: Any) -> Any:
    """Sampling parameters as a dict (``to_dict``'s) with ``logit_bias``'s keys as token
    ids: JSON's are strings, which msgspec reads as ints from JSON text but not from a
    dict."""
    bias = params.get("logit_bias") if isinstance(params, dict) else None
    if not isinstance(bias, dict):
        return params
    return {**params, "logit_bias": {_token_key(k): v for k, v in bias.items()}}


def _unchecked(cls: type) -> type:
    """A Struct of ``cls``'s fields and types without its checks: what ``verify`` has
    msgspec read a Python-built record's attributes into (a record of ``cls`` itself
    would be taken as it is, and would verify itself again)."""
    fields = [(f.name, f.type) for f in msgspec.structs.fields(cls)]
    return msgspec.defstruct(f"_Checked{cls.__name__}", fields)


_CheckedSampling = _unchecked(SamplingParams)


def _float_fields(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` typed float (or float or None)."""

    def is_float(info) -> bool:
        if isinstance(info, msgspec.inspect.UnionType):
            return any(is_float(t) for t in info.types)
        return isinstance(info, msgspec.inspect.FloatType)

    return tuple(
        f.name for f in msgspec.structs.fields(cls) if is_float(msgspec.inspect.type_info(f.type))
    )


_FLOAT_FIELDS = _float_fields(SamplingParams)


def is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON true is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


class LoRARequest(msgspec.Struct, forbid_unknown_fields=True):
    """Which adapter a request runs with. Equal and hashed by adapter id."""

    lora_name: LoraName
    lora_int_id: AdapterId
    lora_path: LoraPath = ""
    base_model_name: str | None = None

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """FieldError (a ValueError) naming the field when one has the wrong type or range."""
        if isinstance(self.lora_path, os.PathLike):
            self.lora_path = os.fspath(self.lora_path)
        try:
            msgspec.convert(self, _CheckedLora, from_attributes=True)
        except msgspec.ValidationError as exc:
            raise invalid(exc, self, LoRARequest, "lora_request") from None

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
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> LoRARequest | None:
        if data is None:
            return None
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise invalid(exc, data, cls, "lora_request") from None


_CheckedLora = _unchecked(LoRARequest)


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
