"""The worker's hold on its entries: fenced lease renewal (``lifecycle.lease.Renew``),
and the abort flags read with it; what a lost entry or an abort asked means here."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lorapool.lifecycle.lease import Renew, abort_flags
from lorapool.worker.held import Held

if TYPE_CHECKING:
    from lorapool.worker.state import WorkerState

logger = logging.getLogger(__name__)


class Lease:
    def __init__(self, state: WorkerState):
        self.state = state
        self._renew = Renew(state.redis)

    def send(self, held: list[Held], idle_ms: int) -> tuple[set, list, set]:
        """RENEW (fenced) for ``held``, one call per shard: the positions in ``held`` of
        the entries another worker took, each one's abort flag, and the positions of
        those that vanished (``lifecycle.lease.RENEW``). Safe on the sender's thread."""
        state = self.state
        lost, flags, vanished = set(), [None] * len(held), set()
        for keys, where in state.by_shard([h.stream for h in held]).items():
            shard_lost, shard_vanished = self._renew(
                state.consumer,
                idle_ms,
                [held[i].stream or keys.requests for i in where],
                [held[i].entry_id for i in where],
            )
            lost.update(where[i] for i in shard_lost)
            vanished.update(where[i] for i in shard_vanished)
            shard_flags = abort_flags(state.redis, keys, [held[i].request_id for i in where])
            for i, flag in zip(where, shard_flags):
                flags[i] = flag
        return lost, flags, vanished

    def apply(self, held: list[Held], lost: set, flags: list, vanished: set = frozenset()) -> None:
        """On the worker's thread: drop the entries another worker took, abort those
        asked to; those that vanished are failed at the next upkeep (``WorkerState.vanished``,
        after the chunks in flight are in: one that just finished is not failed)."""
        state = self.state
        for i, (h, flag) in enumerate(zip(held, flags)):
            if state.held.get(h.request_id) is not h:
                continue  # finished, failed or dropped meanwhile
            if i in vanished:
                state.vanished.append(h)
            elif i in lost:
                logger.warning(
                    "worker %s: lost %s to another worker (its lease ran out, another "
                    "consumer took the entry): dropping it, appending nothing more",
                    state.consumer,
                    h.request_id,
                )
                state.drop(h.request_id)
            elif flag is not None:
                state.engine.abort_request(h.request_id)
