"""Taking over entries whose worker stopped renewing, and other recovery paths."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from lorapool.keys import WORKERS_GROUP
from lorapool.wire import DATA, Chunk, Job, decode_chunk
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
    held = held_for_garbage(entry_id, payload)
    if held is not None:
        for chunk in log:
            held.take(chunk)
    worker.dead_letter(entry_id, payload, reason, held)


def held_for_garbage(entry_id: str, payload: Any) -> Held | None:
    """A Held for an entry that failed validation, if its request id can be read."""
    try:
        data = orjson.loads(payload)
        rid = data["request_id"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    if not isinstance(rid, str) or not rid or any(c in rid for c in "{}"):
        return None
    prompt, metadata = data.get("prompt"), data.get("metadata")
    arrival = data.get("arrival_time")
    job = Job(
        rid,
        prompt if isinstance(prompt, str) else None,
        None,
        _params(data),
        _lora(data),
        metadata if isinstance(metadata, dict) else {},
    )
    if isinstance(arrival, (int, float)) and not isinstance(arrival, bool):
        job.arrival_time = float(arrival)
    return Held(entry_id, job)


def _params(data: dict):
    from lorapool.protocol import SamplingParams

    try:
        return SamplingParams.from_dict(data.get("sampling_params") or {})
    except (TypeError, ValueError):
        return SamplingParams()


def _lora(data: dict):
    from lorapool.protocol import LoRARequest

    try:
        return LoRARequest.from_dict(data.get("lora_request"))
    except (TypeError, ValueError):
        return None


def abort_flagged(worker: Worker, held: list[Held]) -> None:
    """Abort, in the engine, every held request whose abort flag is set."""
    flags = worker.redis.mget([worker.keys.abort(h.request_id) for h in held])
    for h, flag in zip(held, flags):
        if flag is not None and h.request_id in worker.held:
            worker.engine.abort_request(h.request_id)
