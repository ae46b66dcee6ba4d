"""The worker's hold on the pool kept on a thread of its own: lease renewal and the
heartbeat, whatever the worker's thread is doing (an engine step of 30 s on a loaded
CPU, a long prefill).

``Leases``: the entries this worker's consumer holds in the group, those the engine runs
(``WorkerState.hold``) and those a read delivered that the worker's thread has not
started yet (the sender reads while the engine steps: ``Unstarted``). An entry leaves
it when the loop gives it up (finished, failed, lost, handed back): ``remove`` waits
for a renewal on its way, so that once it returns no renewal of that entry is sent
again; a hand-back's long idle time is never undone by a renewal after it.

``Renewer``: every ``lease_s / 3`` the fenced RENEW (``lifecycle.lease``, as the
consumer ``name#incarnation``) of every entry in ``Leases``; every ``heartbeat_s`` the
latest heartbeat record the worker's thread built, with its time refreshed; every
``lease_s``, when it is its turn, the sweep of dead processes' consumers
(``consumers.py``). Their results (entries lost or vanished, abort flags, the pool's
live workers) are applied on the worker's thread (``take``). A stopped process
(SIGSTOP) stops this thread too: its entries return to the pool after the lease. So
does a loop that stopped looping outside an engine step (stuck, or, in a test, a worker
no longer driven) for a lease: the renewer covers the loop's steps, not a loop that is
gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from lorapool.connection import REDIS_DOWN
from lorapool.records.heartbeat import Heartbeat
from lorapool.worker.consumers import ConsumerSweep
from lorapool.worker.lease import Lease
from lorapool.worker.pool import send_heartbeat

if TYPE_CHECKING:
    from lorapool.worker.state import WorkerState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unstarted:
    """An entry a read delivered to this worker, not yet started by its thread."""

    stream: str
    entry_id: str
    request_id: str = ""  # not decoded yet: no abort flag to read


class Leases:
    """The entries to renew, (stream, entry id) -> the ``Held`` or ``Unstarted``; safe
    on any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], Any] = {}

    def add(self, entry: Any) -> None:
        with self._lock:
            self._entries[(entry.stream, entry.entry_id)] = entry

    def remove(self, entry: Any) -> None:
        with self._lock:
            if self._entries.get((entry.stream, entry.entry_id)) is entry:
                del self._entries[(entry.stream, entry.entry_id)]

    def settle(self, stream: str, entry_id: str) -> None:
        """A read entry the worker's thread has dealt with: renewed on only if it holds it."""
        with self._lock:
            if isinstance(self._entries.get((stream, entry_id)), Unstarted):
                del self._entries[(stream, entry_id)]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    @contextmanager
    def renewing(self) -> Iterator[list]:
        """The entries, with the lock held until the renewal of them is done."""
        with self._lock:
            yield list(self._entries.values())


class Renewer:
    def __init__(self, state: WorkerState):
        self.state = state
        self.lease = Lease(state)  # its own script handle; redis-py's pool: its own socket
        self.every_s = state.config.lease_s / 3
        self.consumers = ConsumerSweep(state)  # dead processes' consumers (``consumers.py``)
        self._record: Heartbeat | None = None
        self._results: list[tuple] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"renewer-{state.name}", daemon=True)

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def beat(self, record: Heartbeat) -> None:
        """The worker's latest heartbeat record (built on its thread), sent from now on."""
        with self._cond:
            self._record = record

    def take(self) -> list[tuple]:
        """On the worker's thread: ("lease", entries, (lost, flags, vanished)) and
        ("pool", live heartbeats) results, oldest first."""
        with self._cond:
            results, self._results = self._results, []
        return results

    def looping(self) -> bool:
        """The worker's thread is in an engine step, or looped within the lease."""
        state = self.state
        return state.in_step or time.monotonic() - state.loop_at < state.config.lease_s

    def renew(self) -> None:
        """One fenced renewal of every entry held now (on any thread)."""
        with self.state.leases.renewing() as entries:
            if not entries or not self.looping():
                return
            result = self.lease.send(entries, 0)
        with self._cond:
            self._results.append(("lease", entries, result))

    def send_beat(self) -> None:
        with self._cond:
            record = self._record
        if record is None or not self.looping():
            return
        state = self.state
        record = msgspec.structs.replace(record, updated=time.time())
        live = send_heartbeat(state.redis, state.keys, record, state.config.alive_ttl_s)
        with self._cond:
            self._results.append(("pool", live))

    def sweep(self) -> None:
        """Dead processes' consumers out of the groups, when it is this worker's turn."""
        if self.looping():
            self.consumers.sweep()

    def _run(self) -> None:
        beat_s, lease_s = self.state.config.heartbeat_s, self.state.config.lease_s
        now = time.monotonic()
        due = {"renew": now + self.every_s, "beat": now, "sweep": now + lease_s}
        while True:
            with self._cond:
                wait = max(0.0, min(due.values()) - time.monotonic())
                self._cond.wait_for(lambda: self._closed, timeout=wait)
                if self._closed:
                    return
            now = time.monotonic()
            for what, call, every in (("renew", self.renew, self.every_s),
                                      ("beat", self.send_beat, beat_s),
                                      ("sweep", self.sweep, lease_s)):  # fmt: skip
                if now >= due[what]:
                    due[what] = now + every
                    self._guarded(what, call)

    def _guarded(self, what: str, call) -> None:
        try:
            call()
        except (*REDIS_DOWN, redis.ResponseError) as exc:  # the loop reports Redis away
            logger.debug("worker %s: %s failed (%s)", self.state.name, what, exc)
        except Exception:  # noqa: BLE001 - the thread must outlive one bad call
            logger.exception("worker %s: %s failed", self.state.name, what)
