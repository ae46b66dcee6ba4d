"""What a worker's helpers work on, in one object: the engine, the connection, the
config and keys, and the requests it holds.

The worker (``worker.py``) owns one ``WorkerState`` and passes it to its helpers
(intake, lease, publisher, failover, dead letters, audit, heartbeat), which
take what they need from it and never the ``Worker``. Every change to ``held``
is one of the methods below (``hold``, ``release``, ``drop``, ``forget``,
``release_all``): to learn who changes what a worker holds, read their callers.

All of it belongs to the worker's thread. The sender's thread (``sender.py``)
touches only what a trip hands it: see ``publisher.py``.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

import redis

from lorapool.lifecycle.keys import PRIORITIES, Keys
from lorapool.outputs import RequestOutput
from lorapool.records.adapter import ModelIdentity
from lorapool.worker.config import WorkerConfig
from lorapool.worker.engine_api import EngineInterface
from lorapool.worker.held import Held
from lorapool.worker.metrics import worker_metrics
from lorapool.worker.renewer import Leases

logger = logging.getLogger(__name__)


class WorkerState:
    """One worker's engine, connection, config, keys, held requests and counters."""

    def __init__(
        self,
        engine: EngineInterface,
        connection: redis.Redis,
        config: WorkerConfig,
        base_model: ModelIdentity,
    ):
        self.engine = engine
        self.redis = connection
        self.config = config
        self.name = config.name  # what logs, chunks, audit rows and ``lorapool status`` show
        # the process's consumer in the group: the name and a random incarnation, so that
        # two processes started with one --name (a restart while the old one is frozen)
        # are two consumers, and the fence (XPENDING's consumer: APPEND, RENEW) tells
        # them apart. Everything that reads, claims, renews, appends or hands an entry
        # to a peer, and the heartbeat's hash field and alive key, use it.
        self.incarnation = secrets.token_hex(4)
        self.consumer = f"{config.name}#{self.incarnation}"
        self.base_model = base_model
        self.keys = Keys(config.prefix, config.shards)
        views = self.keys.shard_views
        # every shard's job streams, the interactive ones first (claims go in this order)
        self.streams = tuple(view.stream(p) for p in PRIORITIES for view in views)
        self.view_of = {view.stream(p): view for p in PRIORITIES for view in views}
        self.held: dict[str, Held] = {}  # request id -> what this worker runs of it
        self.leases = Leases()  # the entries the renewer thread renews (``renewer.py``)
        # engine outputs not yet handed to the sender, per held request
        self.pending: dict[str, list[RequestOutput]] = {}
        self.vanished: list[Held] = []  # entries removed under this worker, to fail
        # upkeep calls for the sender's next round trip: (call on the sender, apply here)
        self.extra: list[tuple[Any, Any]] = []
        self.draining = False
        # the worker read new entries after the last step (``Intake.between_steps``):
        # the sender's round trip reads none then
        self.read_between = False
        # new entries the round trip may read (its plan's count while on its way; once it
        # read, set by the sender's thread, those it read) until they are started: not in
        # the engine yet, but their slots are taken (a read between steps leaves them out)
        self.reading = 0
        # for the renewer: the worker's thread is in an engine step / last looped at
        self.in_step = False
        self.loop_at = time.monotonic()
        self.num_tokens = 0  # tokens appended since the last heartbeat
        self.tokens_since: float | None = None  # time.time() of the last heartbeat
        self.metrics = worker_metrics(config, engine, base_model)

    def keys_of(self, stream: str) -> Keys:
        """The keys of the shard an entry of ``stream`` came from: its request's job, out
        and abort keys, and the audit and dead streams it goes to ('': shard 0)."""
        return self.view_of.get(stream) or self.keys.on(0)

    def by_shard(self, streams: list[str]) -> dict[Keys, list[int]]:
        """The positions in ``streams`` grouped by shard (one script call each: a call
        touches the keys of one shard only, a Redis Cluster's rule)."""
        groups: dict[Keys, list[int]] = {}
        for i, stream in enumerate(streams):
            groups.setdefault(self.keys_of(stream), []).append(i)
        return groups

    def tokens_per_s(self) -> float:
        """Tokens appended a second since the last call (the first: over one second);
        the count starts again."""
        now = time.time()
        since = self.tokens_since if self.tokens_since is not None else now - 1
        rate = self.num_tokens / max(1e-6, now - since)
        self.tokens_since, self.num_tokens = now, 0
        return rate

    # --- what the worker holds -------------------------------------------------------

    def hold(self, held: Held) -> None:
        """A request is in the engine: its outputs are this worker's to publish."""
        self.held[held.request_id] = held
        self.leases.add(held)

    def _unhold(self, request_id: str) -> None:
        """Out of ``held`` and of the renewals (none is sent for it once this returns)."""
        held = self.held.pop(request_id, None)
        if held is not None:
            self.leases.remove(held)

    def release(self, request_id: str) -> None:
        """A request ended here (finished or failed with its final chunk)."""
        self._unhold(request_id)

    def drop(self, request_id: str) -> None:
        """A request this worker no longer owns (another took its entry, or its log says
        it is answered): out of the engine, its unsent outputs discarded."""
        self._unhold(request_id)
        self.pending.pop(request_id, None)
        self.engine.abort_request(request_id)

    def forget(self, request_id: str) -> None:
        """A request failed here: as ``drop``, for one that may never have got into
        the engine."""
        self._unhold(request_id)
        self.pending.pop(request_id, None)
        self.abort_in_engine(request_id)

    def release_all(self) -> None:
        """Every held entry handed back to the pool."""
        self.leases.clear()
        self.held.clear()

    def abort_in_engine(self, request_id: str) -> None:
        """Free whatever a request that failed half-way into the engine left there."""
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - it may never have got in
            logger.debug("worker %s: %s was not in the engine", self.name, request_id)
