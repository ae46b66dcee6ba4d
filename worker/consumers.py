"""Deleting the consumers that dead worker processes left in the ``workers`` groups.

Every ``lease_s`` the renewer's thread (``renewer.py``) asks for the pool's turn
(``{p}:consumer-sweep``, SET NX for one lease: one worker sweeps at a time, about once a
lease across the pool). The worker whose turn it is deletes, from each job stream's
group, the consumers for which all of these hold:

- it is not this worker's own;
- it has not read, claimed or renewed for ``DEAD_AFTER_LEASES`` leases (XINFO
  CONSUMERS' idle): a live worker that holds entries renews them (XCLAIM) three times
  a lease (an idle one's empty reads do not count on Redis 7.0: the next condition
  keeps it);
- its liveness flag (``{p}:alive:<consumer>``) is gone: no heartbeat for ``alive_ttl_s``
  (the heartbeat has a thread of its own, ``renewer.py``, so a long engine step does not
  stop it; a SIGSTOP does);
- it holds no pending entry, checked by the script that deletes it
  (``lifecycle.consumers``): one that holds entries stays until the lease path claims
  them, and goes at a later sweep.

A live process whose consumer went all the same (frozen past all of that, nothing
pending) loses nothing: its next read makes the consumer again under the same name,
which is what its fence (APPEND, RENEW) checks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import redis

from lorapool.lifecycle.consumers import DeleteIdle, quiet_consumers

if TYPE_CHECKING:
    from lorapool.worker.state import WorkerState

logger = logging.getLogger(__name__)
DEAD_AFTER_LEASES = 5  # quiet this many leases (and no liveness flag): a dead process's
MAX_PER_SWEEP = 200  # consumers asked about per stream in one sweep (a long pile: several)


class ConsumerSweep:
    """``sweep()``: one sweep if it is this worker's turn; the consumers it deleted."""

    def __init__(self, state: WorkerState):
        self.state = state
        self.delete_idle = DeleteIdle(state.redis)
        self.dead_after_ms = DEAD_AFTER_LEASES * state.config.lease_ms
        self._refused = False  # the ACL's refusal said once

    def sweep(self) -> int:
        try:
            if not self._my_turn():
                return 0
            return self._sweep()
        except redis.ResponseError as exc:
            if not refused_by_acl(exc):
                raise
            if not self._refused:
                self._refused = True
                logger.warning(
                    "worker %s: the consumers of dead processes stay in the group: "
                    "Redis refused (%s); the worker's ACL user needs +xinfo|consumers and "
                    "+xgroup|delconsumer (docs/redis-acl.md)",
                    self.state.name,
                    exc,
                )
            return 0

    def _my_turn(self) -> bool:
        state = self.state
        turn = state.keys.consumer_sweep
        return bool(state.redis.set(turn, state.consumer, nx=True, px=state.config.lease_ms))

    def _sweep(self) -> int:
        state = self.state
        quiet = {stream: self._quiet(stream) for stream in state.streams}
        names = sorted({name for found in quiet.values() for name in found})
        if not names:
            return 0
        flags = state.redis.mget([state.keys.alive(name) for name in names])
        dead = {name for name, flag in zip(names, flags) if flag is None}
        deleted = 0
        for stream, found in quiet.items():
            gone = self.delete_idle(stream, [name for name in found if name in dead])
            if gone:
                logger.info(
                    "worker %s: consumers of dead processes deleted from %s's group: %s",
                    state.name,
                    stream,
                    ", ".join(gone[:5]) + (f" and {len(gone) - 5} more" if len(gone) > 5 else ""),
                )
            deleted += len(gone)
        return deleted

    def _quiet(self, stream: str) -> list[str]:
        try:
            found = quiet_consumers(self.state.redis, stream, self.dead_after_ms)
        except redis.ResponseError as exc:  # no stream or no group yet: nothing to delete
            if refused_by_acl(exc):
                raise
            return []
        return [name for name in found if name != self.state.consumer][:MAX_PER_SWEEP]


def refused_by_acl(exc: redis.ResponseError) -> bool:
    """A refusal of the ACL, of a command or of one a script ran (Redis 7.0 words the
    latter "The user executing the script can't run this command", 7.2 "NOPERM")."""
    text = str(exc)
    return (
        isinstance(exc, redis.exceptions.NoPermissionError)
        or "NOPERM" in text
        or "can't run this command" in text
    )
