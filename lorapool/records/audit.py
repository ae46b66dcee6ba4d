"""The audit record: one finished request, as a worker puts it on ``{p}:audit``.

One typed definition, msgspec Structs: :func:`record_from_output` builds an
:class:`AuditRecord` from a finished request's accumulated chunk (the worker's; a
``RequestOutput`` reads the same), :func:`encode_audit_record`
writes it (``"v": 1`` first, the fields in the order below, plus ``"sig"``, the
worker's signature, :func:`sign_record`), and decoding it validates it against the
same annotations (:func:`record_from_dict`). :func:`parse_record` checks the
signature and validates the rest, and raises :class:`RecordError` with a readable
reason naming the field for anything unsigned, wrongly signed or malformed; the
writer dead-letters those.

The signature is an HMAC of the record's canonical JSON (sorted keys, orjson) as
decoded from the entry, so records signed by earlier versions verify whatever the
order of their fields (``tests/audit_db/test_record_bytes.py`` holds some).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec
import orjson

from lorapool import signing
from lorapool.records.adapter import HASHES, AdapterRecord, ModelIdentity
from lorapool.records.errors import msgspec_path, path_text
from lorapool.records.outputs import RequestTimes

RECORD_VERSION = 1
SIGNATURE_DOMAIN = "lorapool audit record v1"
FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS = get_args(FinishReason)


class RecordError(ValueError):
    """An audit record that cannot be stored; the message says why."""


# The full identity of one adapter version: its registry record as it was when the
# request ran (one definition, ``records.adapter``)
AdapterInfo = AdapterRecord


class Metrics(RequestTimes, frozen=True, kw_only=True):
    """A request's ``RequestMetrics`` as the signed record has had it since version 1:
    the same times, then ``queue_time`` and the two token counts, required."""

    queue_time: float | None = None
    num_prompt_tokens: int
    num_generated_tokens: int


class _Completion(msgspec.Struct, frozen=True):
    # index, text and token_ids positional (``Output(0, "", (), finish_reason=...)``)
    index: int
    text: str
    token_ids: tuple[int, ...]


class Output(_Completion, frozen=True, kw_only=True):
    cumulative_logprob: float | None = None
    finish_reason: FinishReason
    stop_reason: int | str | None = None


class AuditRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished request. The fields a record may leave out (or, for the optional
    ones, set to null) have defaults: the wire's optional fields, written once."""

    v: int = RECORD_VERSION
    request_id: Annotated[str, msgspec.Meta(min_length=1)]
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] = ()
    sampling_params: dict[str, Any] = msgspec.field(default_factory=dict)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    worker: str
    base_model: ModelIdentity
    adapter: AdapterInfo | None = None
    metrics: Metrics
    outputs: tuple[Output, ...]
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The wire dict (``"v": 1`` first; orjson writes its tuples as arrays). The
        adapter's hashes only when known: a record of an adapter registered before them
        is the bytes it always was."""
        data = msgspec.to_builtins(self)
        adapter = data["adapter"]
        if adapter is not None:
            for name in HASHES:
                if name in adapter and adapter[name] is None:
                    del adapter[name]
        return data


# --- decoding --------------------------------------------------------------------

# Null on the wire for these means "none", as leaving them out does.
_NULL_IS_ABSENT = ("prompt_token_ids", "sampling_params", "metadata")


def _invalid(exc: msgspec.ValidationError) -> RecordError:
    """msgspec's reason with the field it names first: ``outputs[0].text: Expected
    `str`, got `null```; ``record: ...`` for the record itself."""
    reason, _, steps = msgspec_path(str(exc))
    where = path_text(steps) or "record"
    if where.endswith(".finish_reason") and reason.startswith("Invalid enum value"):
        reason += f", not one of {FINISH_REASONS}"
    return RecordError(f"{where}: {reason}")


def record_from_dict(data: Any) -> AuditRecord:
    """Validate a decoded record dict; raise :class:`RecordError` when malformed."""
    if type(data) is dict:
        if data.get("v") != RECORD_VERSION:
            raise RecordError(f"unknown record version {data.get('v')!r}")
        if any(data.get(name, ()) is None for name in _NULL_IS_ABSENT):
            data = {k: v for k, v in data.items() if v is not None or k not in _NULL_IS_ABSENT}
    try:
        record = msgspec.convert(data, AuditRecord, strict=True)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None
    indices = [o.index for o in record.outputs]
    if len(set(indices)) != len(indices):
        raise RecordError(f"outputs: duplicate completion index in {indices}")
    return record


def _signature(data: dict[str, Any], key: bytes, pool: str) -> str:
    unsigned = {k: v for k, v in data.items() if k != "sig"}
    body = orjson.dumps(unsigned, option=orjson.OPT_SORT_KEYS)
    return signing.mac(key, SIGNATURE_DOMAIN, pool.encode(), body)


def sign_record(data: AuditRecord | dict[str, Any], key: bytes, pool: str) -> dict[str, Any]:
    """The wire dict of ``data`` with ``"sig"``: HMAC-SHA256 of its canonical JSON,
    for one pool.

    The pool (Redis prefix) is signed too, so a record signed for one pool is
    refused by the writer of another.
    """
    data = data.to_dict() if isinstance(data, AuditRecord) else data
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


def encode_audit_record(
    record: AuditRecord | dict[str, Any], key: bytes | None = None, pool: str | None = None
) -> bytes:
    """The bytes to put in the ``data`` field of an ``{p}:audit`` entry: signed with
    ``key`` for ``pool`` when a key is given (a worker run with --insecure-no-key has none)."""
    data = record.to_dict() if isinstance(record, AuditRecord) else record
    return orjson.dumps(data if key is None else sign_record(data, key, pool))


# --- building a record from a finished request --------------------------------


def _metrics(metrics: Any, num_prompt_tokens: int, num_generated: int) -> Metrics:
    get = (lambda k: getattr(metrics, k, None)) if metrics is not None else (lambda k: None)
    queue_time = get("queue_time") if get("queue_time") is not None else get("time_in_queue")
    return Metrics(
        arrival_time=get("arrival_time") or 0.0,
        first_scheduled_time=get("first_scheduled_time"),
        first_token_time=get("first_token_time"),
        last_token_time=get("last_token_time"),
        finished_time=get("finished_time"),
        queue_time=queue_time,
        num_prompt_tokens=get("num_prompt_tokens") or num_prompt_tokens,
        num_generated_tokens=get("num_generated_tokens") or num_generated,
    )


def _output(completion: Any, error: str | None) -> Output:
    return Output(
        completion.index,
        completion.text,
        tuple(completion.token_ids),
        cumulative_logprob=completion.cumulative_logprob,
        finish_reason=completion.finish_reason or ("error" if error else "abort"),
        stop_reason=completion.stop_reason,
    )


def record_from_output(
    output: Any,
    *,
    worker: str,
    base_model: ModelIdentity,
    adapter: AdapterInfo | dict[str, Any] | None,
    sampling_params: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    error: str | None = None,
) -> AuditRecord:
    """The audit record of one finished request.

    ``output`` is a finished request's accumulated chunk (``records.chunk.Chunk``, the
    worker's: its ``Delta``s) or a ``RequestOutput``, duck-typed: request_id, prompt,
    prompt_token_ids, outputs, metrics, error. ``base_model`` is the worker's
    ``ModelIdentity``; ``adapter`` is None for the base model, else its
    registry record (or that record's dict). No I/O; the values are taken as they
    are (encoded, the record is what the dict before it was, byte for byte).
    """
    error = error if error is not None else getattr(output, "error", None)
    if isinstance(adapter, dict):
        adapter = AdapterInfo(**{**adapter, "target_modules": tuple(adapter["target_modules"])})
    outputs = tuple(_output(c, error) for c in output.outputs)
    prompt_ids = tuple(output.prompt_token_ids or ())
    return AuditRecord(
        request_id=output.request_id,
        prompt=output.prompt,
        prompt_token_ids=prompt_ids,
        sampling_params=dict(sampling_params or {}),
        metadata=dict(metadata or {}),
        worker=worker,
        base_model=base_model,
        adapter=adapter,
        metrics=_metrics(output.metrics, len(prompt_ids), sum(len(o.token_ids) for o in outputs)),
        outputs=outputs,
        error=error,
    )
