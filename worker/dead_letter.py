"""Failing an entry for good: its error output, audit record and dead letter, at once.

Total: whatever an entry holds (any JSON, or none), it ends acknowledged and
dead-lettered; only Redis being away raises (the worker's loop rides that out).
A request whose id can be read also gets a final error chunk and an audit
record, carrying what could be read of it (``held_for_garbage``).
"""

from __future__ import annotations

import logging
import math
import re
from typing import TYPE_CHECKING, Any

import orjson
import redis

from lorapool.connection import REDIS_DOWN
from lorapool.lifecycle import append
from lorapool.lifecycle.append import dead_payload
from lorapool.protocol import FieldError, LoRARequest, SamplingParams, is_int
from lorapool.records.adapter import UnknownAdapter, decode_adapter_record
from lorapool.records.bounds import MAX_REQUEST_ID, REQUEST_ID_FORBIDDEN, is_request_id
from lorapool.records.chunk import decode_chunk
from lorapool.records.error_kind import ErrorKind
from lorapool.records.job import MAX_METADATA_BYTES, Job, JobLimits, encode_job
from lorapool.worker.audit import final_audit
from lorapool.worker.held import Held, error_chunk

if TYPE_CHECKING:
    from lorapool.worker.publisher import Publisher
    from lorapool.worker.state import WorkerState

logger = logging.getLogger(__name__)


def reason_of(exc: BaseException) -> str:
    """An exception as a dead letter's reason: its type unless it is a plain ValueError
    (or one of the pool's own refusals, which say what they are)."""
    text = str(exc) or type(exc).__name__
    plain = type(exc) in (ValueError, FieldError, UnknownAdapter)
    return text if plain else f"{type(exc).__name__}: {text}"


def refuse(
    state: WorkerState,
    publisher: Publisher,
    entry_id: str,
    payload: bytes | None,
    exc: Exception,
    held: Held | None,
    stream: str = "",
) -> None:
    """``dead_letter`` an entry the pool refused (``exc``: why, a request error), with the
    path of the job field it is about when ``exc`` names one (``FieldError.field``)."""
    field = getattr(exc, "field", None)
    field = field if isinstance(field, str) else None
    reason = reason_of(exc)
    kind = ErrorKind.REQUEST
    dead_letter(state, publisher, entry_id, payload, reason, held, stream, kind=kind, field=field)


def dead_letter(
    state: WorkerState,
    publisher: Publisher,
    entry_id: str,
    payload: bytes | None,
    reason: str,
    held: Held | None,
    stream: str = "",
    *,
    kind: ErrorKind,
    field: str | None = None,
) -> None:
    """Final error chunk (when the request is known), XACK and ``{p}:dead``, at once,
    counted in the worker's metrics; written with ``publisher``'s APPEND, on the
    worker's thread with no trip out that holds the request. ``stream``: the entry's
    ('': the interactive one); ``kind``: what failed it, for its readers (``ErrorKind``);
    ``field``: the path of the job field a refusal is about (``FieldError.field``).

    The dead letter keeps the payload only when no audit record keeps the
    prompt (see ``dead_payload``).
    """
    given = held  # what the metrics count: the request, if it was known
    logger.warning("worker %s: dead-lettering %s: %s", state.name, entry_id, reason)
    try:
        if held is None:
            held = held_for_garbage(entry_id, payload, state.config.limits, stream)
        if held is not None:
            state.release(held.request_id)
            find_adapter(state, held)
            chunk = error_chunk(held, reason, state.name, kind, field)
            dead = dead_payload(payload, audited=True)
            held.take(chunk)
            audit = final_audit(state, held, chunk)
            item = publisher.append_item(held, chunk, audit, dead, reason)
            result = publisher.append([item])
            if result == [append.BAD_LOG]:  # no log to write it in
                publisher.append([without_log(item, held, reason)])
            elif result == [append.ANSWERED]:  # another entry runs or ran the request
                why = "answered elsewhere"
                ack_duplicate(state, publisher, held.request_id, entry_id, stream, why)
                return
            state.metrics.failed(given)
            return
    except REDIS_DOWN:
        raise
    except Exception as exc:  # noqa: BLE001 - the dead-letter path must not raise
        logger.exception("worker %s: no error output for %s", state.name, entry_id)
        reason = f"{reason} (and its error output could not be written: {reason_of(exc)})"
    dead = dead_payload(payload, audited=False)
    publisher.append([append.dead_letter(entry_id, dead, reason, stream)])
    state.metrics.failed(given)


def without_log(item: append.Append, held: Held, reason: str) -> append.Append:
    """``item`` (a final one) with no chunk: its ack, audit record and dead letter only,
    for a request whose chunk log key holds another type than a list."""
    logger.warning(
        "request %s: its chunk log key holds another type than a list; failed without "
        "a final chunk: %s",
        held.request_id,
        reason,
    )
    return item._replace(seq=-1, chunk=b"", result=b"")


def ack_duplicate(
    state: WorkerState, publisher: Publisher, rid: str, entry_id: str, stream: str, why: str
) -> None:
    """Ack an entry of a request id that is answered or run by another entry, without
    output, audit record or dead letter: at most one run per request id (the client's
    handle reads the one output of the run that owns it)."""
    logger.warning(
        "worker %s: entry %s of request %s is a duplicate (%s): acked without running",
        state.name,
        entry_id,
        rid,
        why,
    )
    publisher.append([append.Append(rid, entry_id, -1, b"", True, stream=stream)])


def fail_all_vanished(state: WorkerState, publisher: Publisher) -> None:
    """End the requests whose entries an operator removed under this worker (a
    renewal or an append found them pending to no one, or gone from the stream):
    ``fail_vanished`` each. The chunks in flight go first: a request that finished
    meanwhile is not failed (and APPEND refuses a chunk after a final one)."""
    publisher.flush(wait=True)
    vanished, state.vanished = state.vanished, []
    for held in vanished:
        if state.held.get(held.request_id) is held:
            fail_vanished(state, publisher, held)


def fail_vanished(state: WorkerState, publisher: Publisher, held: Held) -> None:
    """Fail a running request whose queue entry was removed under this worker (pending
    to no one, or gone from its stream): its final error chunk (APPEND writes it though
    no one owns the entry), audit record with finish_reason "error" and dead letter.
    Not run again: what removed it was an operator's command (XTRIM, XDEL, XGROUP
    DESTROY/SETID, DEL of the stream), and the request's client learns it at once."""
    rid, stream = held.request_id, held.stream or state.keys_of(held.stream).requests
    reason = (
        f"its queue entry {held.entry_id} was removed from {stream} or its consumer group "
        "while it ran (an operator's XTRIM, XDEL, XGROUP DESTROY/SETID or DEL of the "
        "stream; see README, operator commands): ended here, not run again"
    )
    state.forget(rid)
    held = _as_logged(state, held)
    chunk = error_chunk(held, reason, state.name, ErrorKind.REMOVED)
    held.take(chunk)
    dead = dead_payload(encode_job(held.job), audited=True)
    item = publisher.append_item(held, chunk, final_audit(state, held, chunk), dead, reason)
    result = publisher.append([item._replace(vanished=True)])
    if result != [append.ANSWERED]:
        logger.error("worker %s: failed %s: %s", state.name, rid, reason)
    if result == [append.ANSWERED]:  # it had finished (its final sent again, acked), or
        # nothing in Redis says it runs (marker and log deleted): not failed twice
        logger.info("worker %s: %s had finished, or is forgotten: left", state.name, rid)
        return
    if result == [append.BAD_LOG]:
        publisher.append([without_log(item, held, reason)._replace(vanished=True)])
    state.metrics.failed(held)


def _as_logged(state: WorkerState, held: Held) -> Held:
    """``held`` as its chunk log has it: chunks built after the entry vanished were
    refused, so the error chunk goes right after the last one that landed (no gap for
    readers to wait on). ``held`` itself when the log cannot be read."""
    keys = state.keys_of(held.stream)
    try:
        log = state.redis.lrange(keys.out(held.request_id), 0, -1)
        fresh = Held(held.entry_id, held.job, adapter=held.adapter, stream=held.stream)
        for raw in log:
            fresh.take(decode_chunk(raw, held.request_id))
    except (redis.ResponseError, ValueError, KeyError, TypeError):
        return held
    return fresh


def fail_unwritable(state: WorkerState, publisher: Publisher, held: Held, key: str) -> None:
    """Fail a running request whose chunk log cannot be written (APPEND said
    ``BAD_LOG``: its key holds another type than a list, nothing was written): ack,
    audit record with finish_reason "error", dead letter; the worker goes on."""
    rid = held.request_id
    reason = (
        f"the chunk log key {key} holds a value of another type than a list "
        "(written by something other than the pool's workers): WRONGTYPE"
    )
    logger.warning("worker %s: failing %s: %s", state.name, rid, reason)
    state.forget(rid)
    chunk = error_chunk(held, reason, state.name, ErrorKind.STORAGE)
    held.take(chunk)
    dead = dead_payload(encode_job(held.job), audited=True)
    item = publisher.append_item(held, chunk, final_audit(state, held, chunk), dead, reason)
    publisher.append([item._replace(seq=-1, chunk=b"", result=b"")])
    state.metrics.failed(held)


def find_adapter(state: WorkerState, held: Held) -> None:
    """The registry record of a failed job's adapter, for its audit record, if it matches."""
    lora = held.job.lora_request
    if held.adapter is None and lora is not None:
        try:
            record = decode_adapter_record(state.redis.hget(state.keys.adapters, lora.name))
        except (ValueError, redis.ResponseError):  # a damaged registry record or key:
            return  # audit the request without it
        if record is not None and record.id == lora.lora_int_id:
            held.adapter = record


def held_for_garbage(
    entry_id: str, payload: Any, limits: JobLimits, stream: str = ""
) -> Held | None:
    """A Held for an entry that failed validation, if its request id can be read.

    Total: any payload gives a Held or None. Fields that do not pass are left
    out (a default SamplingParams, no adapter, no metadata, no oversized prompt),
    so the request's error output and audit record carry what could be read.
    """
    try:
        held = _held_for_garbage(entry_id, payload, limits)
    except Exception:  # noqa: BLE001 - the dead-letter path must not raise
        logger.exception("no request could be read from %s", entry_id)
        return None
    if held is not None:
        held.stream = stream
    return held


def _held_for_garbage(entry_id: str, payload: Any, limits: JobLimits) -> Held | None:
    try:
        data = orjson.loads(payload)
        rid = data["request_id"]
    except orjson.JSONDecodeError:
        # unparsable (nested past the parser's depth, cut short...): a request id that
        # can still be read gets its final error chunk (its client is waiting on it)
        data, rid = {}, _readable_id(payload)
        if rid is None:
            return None
    except (KeyError, TypeError):
        return None
    if not is_request_id(rid):
        return None
    prompt, metadata = data.get("prompt"), data.get("metadata")
    if not isinstance(prompt, str) or len(prompt) > limits.max_prompt_bytes:
        prompt = None
    if not isinstance(metadata, dict) or len(orjson.dumps(metadata)) > MAX_METADATA_BYTES:
        metadata = {}
    job = Job(rid, prompt, None, _params(data, limits), _lora(data), metadata)
    arrival = data.get("arrival_time")
    if isinstance(arrival, float) and math.isfinite(arrival) and arrival >= 0:
        job.arrival_time = arrival
    elif is_int(arrival) and 0 <= arrival < 2**53:
        job.arrival_time = float(arrival)
    return Held(entry_id, job)


_REQUEST_ID = re.compile(
    rb'"request_id"\s*:\s*"([^"\\%s]{1,%d})"'
    % (re.escape(REQUEST_ID_FORBIDDEN.encode()), MAX_REQUEST_ID)
)


def _readable_id(payload: Any) -> str | None:
    """The request id of a payload the parser refused, when it names exactly one."""
    raw = payload if isinstance(payload, bytes) else str(payload).encode("utf-8", "replace")
    found = set(_REQUEST_ID.findall(raw[: 1 << 20]))
    if len(found) != 1:
        return None
    try:
        return found.pop().decode()
    except UnicodeDecodeError:
        return None


def _params(data: dict, limits: JobLimits) -> SamplingParams:
    try:
        params = SamplingParams.from_dict(data.get("sampling_params") or {})
    except (TypeError, ValueError):
        return SamplingParams()
    return params if params.n <= limits.max_n else SamplingParams()


def _lora(data: dict) -> LoRARequest | None:
    try:
        return LoRARequest.from_dict(data.get("lora_request"))
    except (TypeError, ValueError):
        return None
