"""Taking over entries whose worker stopped renewing, and other recovery paths."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lorapool.lifecycle import lease
from lorapool.records.chunk import Chunk
from lorapool.records.error_kind import ErrorKind
from lorapool.records.job import DATA
from lorapool.worker import dead_letter

if TYPE_CHECKING:
    from collections.abc import Callable

    from lorapool.worker.publisher import Publisher
    from lorapool.worker.state import WorkerState

logger = logging.getLogger(__name__)


def claim(state: WorkerState, publisher: Publisher, start: Callable[..., None]) -> int:
    """Claim entries idle past the lease (as many as the engine can take) and resume them
    (``start``: ``Worker.start``).

    An entry delivered more than ``max_deliveries`` times is dead-lettered and
    its client gets a final error output.

    The engine's capacity is counted once, before the first stream: the entries
    claimed from one stream wait in the engine until its next step, and
    ``capacity()`` counts them as taken, so counting it per stream left the other
    streams (the other shards' on a Redis Cluster) to a later round, ``lease_s / 2``
    each.
    """
    budget, claimed = state.engine.capacity(), 0
    for stream in state.streams:  # the interactive ones first
        if claimed >= budget:
            break
        claimed += _claim(state, publisher, start, stream, budget - claimed)
    return claimed


def _claim(
    state: WorkerState, publisher: Publisher, start: Callable[..., None], stream: str, count: int
) -> int:
    name, config = state.name, state.config
    entries = lease.claim_idle(state.redis, stream, state.consumer, config.lease_ms, count)
    for entry_id, fields in entries:
        deliveries = lease.deliveries(state.redis, stream, entry_id)
        logger.info("worker %s: claimed %s %s (delivery %s)", name, stream, entry_id, deliveries)
        log = lease.read_log(state.redis, state.keys_of(stream), fields)
        if deliveries > config.max_deliveries:
            _give_up(state, publisher, (stream, entry_id, fields, log, deliveries))
        else:
            start(entry_id, fields, log, stream)
    return len(entries)


def _give_up(
    state: WorkerState, publisher: Publisher, claimed: tuple[str, str, dict, list[Chunk], int]
) -> None:
    """Dead-letter a claimed entry (stream, id, fields, chunk log, deliveries) delivered
    too often, with what its log holds."""
    stream, entry_id, fields, log, deliveries = claimed
    limits = state.config.limits
    payload = fields.get(DATA.encode())
    reason = (
        f"delivered {deliveries} times (max_deliveries={state.config.max_deliveries}); "
        f"the workers that took it stopped before finishing"
    )
    held = dead_letter.held_for_garbage(entry_id, payload, limits, stream)
    try:
        for chunk in log if held is not None else []:
            held.take(chunk)
    except Exception:  # noqa: BLE001 - a damaged log: fail the request without it
        logger.exception("worker %s: unreadable chunk log of %s", state.name, entry_id)
        held = dead_letter.held_for_garbage(entry_id, payload, limits, stream)
    kind = ErrorKind.GIVEN_UP
    dead_letter.dead_letter(state, publisher, entry_id, payload, reason, held, stream, kind=kind)
