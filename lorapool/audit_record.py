"""The audit record: one finished request, as a worker puts it on ``{p}:audit``.

A stream entry's field ``data`` holds the orjson of :meth:`AuditRecord.to_dict`
(``"v": 1``) plus ``"sig"``, the worker's signature (:func:`sign_record`).
:func:`parse_record` checks the signature and validates the rest, and raises
:class:`RecordError` with a readable reason for anything unsigned, wrongly
signed or malformed; the writer dead-letters those. :func:`record_from_output`
builds the dict from a finished ``RequestOutput``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

import orjson

from lorapool import signing
from lorapool.lifecycle.adapter_record import AdapterRecord

RECORD_VERSION = 1
SIGNATURE_DOMAIN = "lorapool audit record v1"
FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS = get_args(FinishReason)


class RecordError(ValueError):
    """An audit record that cannot be stored; the message says why."""


@dataclass(frozen=True)
class BaseModelInfo:
    name: str
    sha256: str


# The full identity of one adapter version: its registry record as it was when the
# request ran (one definition, ``lifecycle.adapter_record``)
AdapterInfo = AdapterRecord


@dataclass(frozen=True)
class Metrics:
    arrival_time: float
    first_scheduled_time: float | None = field(default=None, kw_only=True)
    first_token_time: float | None = field(default=None, kw_only=True)
    last_token_time: float | None = field(default=None, kw_only=True)
    finished_time: float | None = field(default=None, kw_only=True)
    queue_time: float | None = field(default=None, kw_only=True)
    num_prompt_tokens: int
    num_generated_tokens: int


@dataclass(frozen=True)
class Output:
    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None = field(default=None, kw_only=True)
    finish_reason: FinishReason
    stop_reason: int | str | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class AuditRecord:
    """One finished request. The fields a record may leave out (or, for the optional
    ones, set to null) have defaults: the wire's optional fields, written once."""

    request_id: str
    prompt: str | None = field(default=None, kw_only=True)
    prompt_token_ids: tuple[int, ...] = field(default=(), kw_only=True)
    sampling_params: dict[str, Any] = field(default_factory=dict, kw_only=True)
    metadata: dict[str, Any] = field(default_factory=dict, kw_only=True)
    worker: str
    base_model: BaseModelInfo
    adapter: AdapterInfo | None = field(default=None, kw_only=True)
    metrics: Metrics
    outputs: tuple[Output, ...]
    error: str | None = field(default=None, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        """The wire dict (``"v": 1``), tuples as lists."""
        data = asdict(self)
        data["v"] = RECORD_VERSION
        return data


# --- validation helpers: each returns the value or raises RecordError ---------


def _get(data: dict, key: str, where: str) -> Any:
    if key not in data:
        raise RecordError(f"{where}: missing field {key!r}")
    return data[key]


def _str(value: Any, where: str, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        raise RecordError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(f"{where}: expected an integer, got {type(value).__name__}")
    return value


def _float(value: Any, where: str, nullable: bool = False) -> float | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{where}: expected a number, got {type(value).__name__}")
    return float(value)


def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise RecordError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise RecordError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _ints(value: Any, where: str) -> tuple[int, ...]:
    items = _list(value, where)
    if items and set(map(type, items)) != {int}:  # type(), not isinstance(): no bools
        raise RecordError(f"{where}: expected a list of integers")
    return tuple(items)


# --- parsing -------------------------------------------------------------------


def _base_model(data: Any) -> BaseModelInfo:
    data = _dict(data, "base_model")
    return BaseModelInfo(
        name=_str(_get(data, "name", "base_model"), "base_model.name"),
        sha256=_str(_get(data, "sha256", "base_model"), "base_model.sha256"),
    )


def _adapter(data: Any) -> AdapterInfo | None:
    if data is None:
        return None
    data = _dict(data, "adapter")
    targets = _list(_get(data, "target_modules", "adapter"), "adapter.target_modules")
    return AdapterInfo(
        name=_str(_get(data, "name", "adapter"), "adapter.name"),
        id=_int(_get(data, "id", "adapter"), "adapter.id"),
        path=_str(_get(data, "path", "adapter"), "adapter.path"),
        sha256=_str(_get(data, "sha256", "adapter"), "adapter.sha256"),
        rank=_int(_get(data, "rank", "adapter"), "adapter.rank"),
        alpha=_float(_get(data, "alpha", "adapter"), "adapter.alpha"),
        target_modules=tuple(_str(t, "adapter.target_modules[]") for t in targets),
        base_model=_str(data.get("base_model"), "adapter.base_model", nullable=True),
    )


_OPTIONAL_TIMES = (
    "first_scheduled_time",
    "first_token_time",
    "last_token_time",
    "finished_time",
    "queue_time",
)


def _metrics(data: Any) -> Metrics:
    data = _dict(data, "metrics")
    times = {k: _float(data.get(k), f"metrics.{k}", nullable=True) for k in _OPTIONAL_TIMES}
    return Metrics(
        arrival_time=_float(_get(data, "arrival_time", "metrics"), "metrics.arrival_time"),
        num_prompt_tokens=_int(
            _get(data, "num_prompt_tokens", "metrics"), "metrics.num_prompt_tokens"
        ),
        num_generated_tokens=_int(
            _get(data, "num_generated_tokens", "metrics"), "metrics.num_generated_tokens"
        ),
        **times,
    )


def _output(data: Any, position: int) -> Output:
    where = f"outputs[{position}]"
    data = _dict(data, where)
    reason = _get(data, "finish_reason", where)
    if reason not in FINISH_REASONS:
        raise RecordError(f"{where}.finish_reason: {reason!r} is not one of {FINISH_REASONS}")
    stop = data.get("stop_reason")
    if stop is not None and (isinstance(stop, bool) or not isinstance(stop, (int, str))):
        raise RecordError(f"{where}.stop_reason: expected an int, a string or null")
    return Output(
        index=_int(_get(data, "index", where), f"{where}.index"),
        text=_str(_get(data, "text", where), f"{where}.text"),
        token_ids=_ints(_get(data, "token_ids", where), f"{where}.token_ids"),
        cumulative_logprob=_float(
            data.get("cumulative_logprob"), f"{where}.cumulative_logprob", nullable=True
        ),
        finish_reason=reason,
        stop_reason=stop,
    )


def _outputs(data: Any) -> tuple[Output, ...]:
    outputs = tuple(_output(o, i) for i, o in enumerate(_list(data, "outputs")))
    indices = [o.index for o in outputs]
    if len(set(indices)) != len(indices):
        raise RecordError(f"outputs: duplicate completion index in {indices}")
    return outputs


def record_from_dict(data: Any) -> AuditRecord:
    """Validate a decoded record dict; raise :class:`RecordError` when malformed."""
    data = _dict(data, "record")
    version = data.get("v")
    if version != RECORD_VERSION:
        raise RecordError(f"unknown record version {version!r}")
    request_id = _str(_get(data, "request_id", "record"), "request_id")
    if not request_id:
        raise RecordError("request_id: must not be empty")
    return AuditRecord(
        request_id=request_id,
        prompt=_str(data.get("prompt"), "prompt", nullable=True),
        prompt_token_ids=_ints(data.get("prompt_token_ids") or [], "prompt_token_ids"),
        sampling_params=_dict(data.get("sampling_params") or {}, "sampling_params"),
        metadata=_dict(data.get("metadata") or {}, "metadata"),
        worker=_str(_get(data, "worker", "record"), "worker"),
        base_model=_base_model(_get(data, "base_model", "record")),
        adapter=_adapter(data.get("adapter")),
        metrics=_metrics(_get(data, "metrics", "record")),
        outputs=_outputs(_get(data, "outputs", "record")),
        error=_str(data.get("error"), "error", nullable=True),
    )


def _signature(data: dict[str, Any], key: bytes, pool: str) -> str:
    unsigned = {k: v for k, v in data.items() if k != "sig"}
    body = orjson.dumps(unsigned, option=orjson.OPT_SORT_KEYS)
    return signing.mac(key, SIGNATURE_DOMAIN, pool.encode(), body)


def sign_record(data: dict[str, Any], key: bytes, pool: str) -> dict[str, Any]:
    """``data`` with ``"sig"``: HMAC-SHA256 of its canonical JSON, for one pool.

    The pool (Redis prefix) is signed too, so a record signed for one pool is
    refused by the writer of another.
    """
    return {**data, "sig": _signature(data, key, pool)}


def check_signature(data: Any, key: bytes, pool: str) -> None:
    """Raise :class:`RecordError` unless ``data`` was signed with ``key`` for ``pool``."""
    sig = data.get("sig") if isinstance(data, dict) else None
    if sig is None:
        raise RecordError("unsigned record: no 'sig' field (not written by a worker with the key)")
    if not isinstance(sig, str) or not signing.same(sig, _signature(data, key, pool)):
        raise RecordError(
            f"bad signature: the record was not signed with the audit key for pool {pool!r} "
            "(forged, altered after signing, or signed for another pool)"
        )


def decode_signed(payload: bytes | str, key: bytes | None = None, pool: str | None = None) -> Any:
    """The JSON value of one ``{p}:audit`` entry, its signature checked when ``key`` is
    given; not validated yet."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise RecordError(f"not valid JSON: {exc}") from None
    if key is not None:
        if pool is None:
            raise ValueError("checking a signature needs the pool")
        check_signature(data, key, pool)
    return data


def parse_record(
    payload: bytes | str, key: bytes | None = None, pool: str | None = None
) -> AuditRecord:
    """Decode, authenticate (when ``key`` is given) and validate one ``{p}:audit`` entry."""
    return record_from_dict(decode_signed(payload, key, pool))


def encode_audit_record(record: AuditRecord | dict[str, Any]) -> bytes:
    """The bytes to put in the ``data`` field of an ``{p}:audit`` entry."""
    data = record.to_dict() if isinstance(record, AuditRecord) else record
    return orjson.dumps(data)


# --- building a record from a finished request --------------------------------


def _metrics_dict(metrics: Any, num_prompt_tokens: int, num_generated: int) -> dict[str, Any]:
    get = (lambda k: getattr(metrics, k, None)) if metrics is not None else (lambda k: None)
    queue_time = get("queue_time") if get("queue_time") is not None else get("time_in_queue")
    return {
        "arrival_time": get("arrival_time") or 0.0,
        "first_scheduled_time": get("first_scheduled_time"),
        "first_token_time": get("first_token_time"),
        "last_token_time": get("last_token_time"),
        "finished_time": get("finished_time"),
        "queue_time": queue_time,
        "num_prompt_tokens": get("num_prompt_tokens") or num_prompt_tokens,
        "num_generated_tokens": get("num_generated_tokens") or num_generated,
    }


def _output_dict(completion: Any, error: str | None) -> dict[str, Any]:
    reason = completion.finish_reason or ("error" if error else "abort")
    return {
        "index": completion.index,
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "cumulative_logprob": completion.cumulative_logprob,
        "finish_reason": reason,
        "stop_reason": completion.stop_reason,
    }


def record_from_output(
    output: Any,
    *,
    worker: str,
    base_model: dict[str, str],
    adapter: dict[str, Any] | None,
    sampling_params: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """The audit record dict of one finished request.

    ``output`` is a finished ``RequestOutput`` (duck-typed: request_id, prompt,
    prompt_token_ids, outputs, metrics, error). ``base_model`` is
    ``{"name", "sha256"}``; ``adapter`` is None for the base model, else
    ``{"name", "id", "path", "sha256", "rank", "alpha", "target_modules",
    "base_model"}`` from the adapter registry. Pure dict building, no I/O.
    """
    error = error if error is not None else getattr(output, "error", None)
    prompt_ids = list(output.prompt_token_ids or [])
    outputs = [_output_dict(c, error) for c in output.outputs]
    num_generated = sum(len(o["token_ids"]) for o in outputs)
    return {
        "v": RECORD_VERSION,
        "request_id": output.request_id,
        "prompt": output.prompt,
        "prompt_token_ids": prompt_ids,
        "sampling_params": dict(sampling_params or {}),
        "metadata": dict(metadata or {}),
        "worker": worker,
        "base_model": dict(base_model),
        "adapter": None if adapter is None else dict(adapter),
        "metrics": _metrics_dict(output.metrics, len(prompt_ids), num_generated),
        "outputs": outputs,
        "error": error,
    }
