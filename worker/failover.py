"""Taking over entries whose worker stopped renewing, and other recovery paths."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lorapool.lifecycle import lease
from lorapool.lifecycle.error_kind import ErrorKind
from lorapool.lifecycle.wire import DATA, Chunk
from lorapool.worker import dead_letter

if TYPE_CHECKING:
    from lorapool.worker.worker import Worker

logger = logging.getLogger(__name__)


def claim(worker: Worker) -> int:
    """Claim entries idle past the lease (as many as the engine can take) and resume them.

    An entry delivered more than ``max_deliveries`` times is dead-lettered and
    its client gets a final error output.

    The engine's capacity is counted once, before the first stream: the entries
    claimed from one stream wait in the engine until its next step, and
    ``capacity()`` counts them as taken, so counting it per stream left the other
    streams (the other shards' on a Redis Cluster) to a later round, ``lease_s / 2``
    each.
    """
    budget, claimed = worker.engine.capacity(), 0
    for stream in worker.streams:  # the interactive ones first
        if claimed >= budget:
            break
        claimed += _claim(worker, stream, budget - claimed)
    return claimed


def _claim(worker: Worker, stream: str, count: int) -> int:
    entries = lease.claim_idle(worker.redis, stream, worker.name, worker.config.lease_ms, count)
    for entry_id, fields in entries:
        deliveries = lease.deliveries(worker.redis, stream, entry_id)
        logger.info(
            "worker %s: claimed %s %s (delivery %s)", worker.name, stream, entry_id, deliveries
        )
        log = lease.read_log(worker.redis, worker.keys_of(stream), fields)
        if deliveries > worker.config.max_deliveries:
            _give_up(worker, stream, entry_id, fields, log, deliveries)
        else:
            worker.start(entry_id, fields, log, stream)
    return len(entries)


def _give_up(
    worker: Worker, stream: str, entry_id: str, fields: dict, log: list[Chunk], deliveries: int
) -> None:
    payload = fields.get(DATA.encode())
    reason = (
        f"delivered {deliveries} times (max_deliveries={worker.config.max_deliveries}); "
        f"the workers that took it stopped before finishing"
    )
    held = dead_letter.held_for_garbage(entry_id, payload, worker.config.limits, stream)
    try:
        for chunk in log if held is not None else []:
            held.take(chunk)
    except Exception:  # noqa: BLE001 - a damaged log: fail the request without it
        logger.exception("worker %s: unreadable chunk log of %s", worker.name, entry_id)
        held = dead_letter.held_for_garbage(entry_id, payload, worker.config.limits, stream)
    kind = ErrorKind.GIVEN_UP
    dead_letter.dead_letter(worker, entry_id, payload, reason, held, stream, kind=kind)
