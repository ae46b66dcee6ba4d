"""What the engine returns, mirroring vLLM's output types, and their wire form.

Torch-free. ``RequestOutput`` carries ``CompletionOutput``s (one per sample),
``RequestMetrics`` and, per position, ``Logprob``s; every type converts to and
from plain dicts (``to_dict`` / ``from_dict``) that orjson serializes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from lorapool.records.params import WIRE_VERSION, LoRARequest, check


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


class RequestTimes(msgspec.Struct):
    """When a request arrived, was first scheduled, gave its first and last token, and
    finished (``time.time()`` seconds): the fields both metrics records begin with, in
    this order, written once here."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


class RequestMetrics(RequestTimes, gc=False):
    """Timestamps and token counts of one request: vLLM's fields, and the typed ``m`` of
    a request's first and final chunk (``records.chunk``; every field written, in this
    order: the bytes the dict it replaces wrote). The signed audit record's
    ``audit.Metrics`` has the same times, its queue time under the name the signed rows
    have (``queue_time``), and no cached-token count."""

    time_in_queue: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return self.time_in_queue

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RequestMetrics | None:
        """ValueError naming the field when one has the wrong type."""
        if data is None:
            return None
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"malformed metrics: {exc}") from None


# the request's own fields ``RequestOutput.add`` takes from a later output that has them
_LATEST = (
    "metrics",
    "error",
    "error_kind",
    "error_field",
    "worker",
    "num_cached_tokens",
    "prompt_logprobs",
)


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
        # with an error, what failed it (``records.error_kind.ErrorKind``, a str)
        self.error_kind: str | None = kwargs.pop("error_kind", None)
        self.worker: str | None = kwargs.pop("worker", None)
        # with a refusal, the path of the job field it is about (``FieldError.field``:
        # ``"sampling_params.logprobs"``, ``"adapter"``), when the refusal named one
        self.error_field: str | None = kwargs.pop("error_field", None)

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one.

        aggregate=True appends text, token ids and logprobs and takes the later
        cumulative_logprob, finish_reason and stop_reason; aggregate=False
        replaces the completion with the same index. Unknown indices are appended.
        """
        self.finished |= next_output.finished
        for key in _LATEST:
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
            **wire_head(self),
            "prompt_logprobs": logprobs_to_wire(self.prompt_logprobs),
            "outputs": [c.to_dict(with_lora=False) for c in self.outputs],
            "finished": self.finished,
            "metrics": None if self.metrics is None else self.metrics.to_dict(),
            "lora_request": _lora_dict(self.lora_request),
            "num_cached_tokens": self.num_cached_tokens,
            "error": self.error,
            "error_kind": self.error_kind,
            "worker": self.worker,
            **({"error_field": self.error_field} if self.error_field is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestOutput:
        version = data.get("v", WIRE_VERSION)
        check(version == WIRE_VERSION, f"unknown wire version {version!r}")
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
            error_kind=data.get("error_kind"),
            worker=data.get("worker"),
            error_field=data.get("error_field"),
        )

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"outputs={self.outputs!r}, finished={self.finished}, "
            f"lora_request={self.lora_request!r}, metrics={self.metrics!r})"
        )


def wire_head(request: Any) -> dict[str, Any]:
    """What a job and each of its outputs open with on the wire: version, id, prompt."""
    return {
        "v": WIRE_VERSION,
        "request_id": request.request_id,
        "prompt": request.prompt,
        "prompt_token_ids": request.prompt_token_ids,
    }


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
    "CompletionOutput",
    "Logprob",
    "PromptLogprobs",
    "RequestMetrics",
    "RequestOutput",
    "SampleLogprobs",
    "logprobs_from_wire",
    "logprobs_to_wire",
    "wire_head",
]
