"""Taking over entries whose worker stopped renewing, and other recovery paths."""

from __future__ import annotations

import hashlib
import logging
import math
from typing import TYPE_CHECKING, Any

import orjson

from lorapool.keys import WORKERS_GROUP
from lorapool.protocol import LoRARequest, SamplingParams, is_int
from lorapool.wire import (
    DATA,
    MAX_METADATA_BYTES,
    MAX_REQUEST_ID,
    Chunk,
    Job,
    JobLimits,
    decode_chunk,
)
from lorapool.worker.held import Held

if TYPE_CHECKING:
    from lorapool.worker.worker import Worker

logger = logging.getLogger(__name__)


def claim(worker: Worker) -> int:
    """Claim entries idle past the lease (as many as the engine can take) and resume them.

    An entry delivered more than ``max_deliveries`` times is dead-lettered and
    its client gets a final error output.
    """
    count = worker.capacity()
    if count == 0:
        return 0
    reply = worker.redis.xautoclaim(
        worker.keys.requests,
        WORKERS_GROUP,
        worker.name,
        min_idle_time=worker.config.lease_ms,
        start_id="0-0",
        count=count,
    )
    entries = [(i, f) for i, f in reply[1] if f]
    for entry_id, fields in entries:
        entry_id = entry_id.decode()
        deliveries = _deliveries(worker, entry_id)
        logger.info("worker %s: claimed %s (delivery %s)", worker.name, entry_id, deliveries)
        log = read_log(worker, fields)
        if deliveries > worker.config.max_deliveries:
            _give_up(worker, entry_id, fields, log, deliveries)
        else:
            worker.start(entry_id, fields, log)
    return len(entries)


def _deliveries(worker: Worker, entry_id: str) -> int:
    info = worker.redis.xpending_range(
        worker.keys.requests, WORKERS_GROUP, min=entry_id, max=entry_id, count=1
    )
    return info[0]["times_delivered"] if info else 0


def read_log(worker: Worker, fields: dict) -> list[Chunk]:
    """The chunks already in the entry's chunk log (empty when it cannot be decoded)."""
    try:
        rid = orjson.loads(fields.get(DATA.encode()))["request_id"]
        entries = worker.redis.xrange(worker.keys.out(rid))
        return [decode_chunk(f.get(DATA.encode())) for _, f in entries]
    except (ValueError, KeyError, TypeError):
        return []


def _give_up(
    worker: Worker, entry_id: str, fields: dict, log: list[Chunk], deliveries: int
) -> None:
    payload = fields.get(DATA.encode())
    reason = (
        f"delivered {deliveries} times (max_deliveries={worker.config.max_deliveries}); "
        f"the workers that took it stopped before finishing"
    )
    held = held_for_garbage(entry_id, payload, worker.config.limits)
    try:
        for chunk in log if held is not None else []:
            held.take(chunk)
    except Exception:  # noqa: BLE001 - a damaged log: fail the request without it
        logger.exception("worker %s: unreadable chunk log of %s", worker.name, entry_id)
        held = held_for_garbage(entry_id, payload, worker.config.limits)
    worker.dead_letter(entry_id, payload, reason, held)


def held_for_garbage(entry_id: str, payload: Any, limits: JobLimits) -> Held | None:
    """A Held for an entry that failed validation, if its request id can be read.

    Total: any payload gives a Held or None. Fields that do not pass are left
    out (a default SamplingParams, no adapter, no metadata, no oversized prompt),
    so the request's error output and audit record carry what could be read.
    """
    try:
        return _held_for_garbage(entry_id, payload, limits)
    except Exception:  # noqa: BLE001 - the dead-letter path must not raise
        logger.exception("no request could be read from %s", entry_id)
        return None


def _held_for_garbage(entry_id: str, payload: Any, limits: JobLimits) -> Held | None:
    try:
        data = orjson.loads(payload)
        rid = data["request_id"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    if not isinstance(rid, str) or not rid or len(rid) > MAX_REQUEST_ID:
        return None
    if any(c in rid for c in "{}\x00"):
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


MAX_DEAD_PAYLOAD = 64 << 10


def dead_payload(payload: Any, audited: bool) -> bytes:
    """What a dead letter keeps of an entry's payload.

    When an audit record was written for the request it keeps the prompt, so
    the dead letter keeps only the payload's sha256 and length; otherwise the
    payload itself up to 64 KiB (beyond that, its sha256, length and head).
    """
    if payload is None:
        return b"null"
    raw = payload if isinstance(payload, bytes) else str(payload).encode("utf-8", "replace")
    if not audited and len(raw) <= MAX_DEAD_PAYLOAD:
        return raw
    summary = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    if not audited:
        summary["head"] = raw[:1024].decode("utf-8", "replace")
    return orjson.dumps(summary)


def abort_flagged(worker: Worker, held: list[Held]) -> None:
    """Abort, in the engine, every held request whose abort flag is set."""
    flags = worker.redis.mget([worker.keys.abort(h.request_id) for h in held])
    for h, flag in zip(held, flags):
        if flag is not None and h.request_id in worker.held:
            worker.engine.abort_request(h.request_id)
