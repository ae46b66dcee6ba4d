"""The queue worker: one engine, fed from the ``workers`` consumer group.

Loop: upkeep (lease renewal, claiming abandoned entries, heartbeat) → admit what the
engine can take now → one engine step → entries for its free slots (``Intake``) → its
outputs to the publisher (``publisher.py``), whose sender thread appends them (fenced:
``lorapool.lifecycle.append``) in one round trip while the engine runs its next step.

What the helpers work on (the engine, the connection, the config and keys, the held
requests) is one ``WorkerState`` (``state.py``), handed to each; none gets the
``Worker``, and none reaches a private member (tests/unit/test_worker_privacy.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from lorapool import signing
from lorapool.connection import REDIS_DOWN, ensure_group, out_of_memory
from lorapool.lifecycle import run_state
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.persistence import persistence_warning
from lorapool.records.adapter import ModelIdentity
from lorapool.records.chunk import Chunk
from lorapool.records.error_kind import ErrorKind
from lorapool.records.heartbeat import Heartbeat
from lorapool.records.job import DATA, decode_job, encode_job
from lorapool.startup import until_redis_takes
from lorapool.worker import dead_letter, failover, signals, unread_audit
from lorapool.worker.config import WorkerConfig
from lorapool.worker.dead_letter import reason_of
from lorapool.worker.engine_api import EngineInterface
from lorapool.worker.held import Held
from lorapool.worker.intake import Intake
from lorapool.worker.lease import Lease
from lorapool.worker.pool import claim_model, heartbeat_record, send_heartbeat, warn_same_name
from lorapool.worker.prompt import add_to_engine
from lorapool.worker.publisher import Publisher
from lorapool.worker.renewer import Renewer
from lorapool.worker.state import WorkerState

logger = logging.getLogger(__name__)
BACKOFF_S = (0.1, 5.0)  # first and longest wait between tries while Redis is away


class Worker:
    """Drives one ``LLMEngine`` from the request stream. ``base_model``: its ``ModelIdentity``.

    Refuses to start (AuditKeyError) without an audit key to sign audit records
    with, unless ``config.insecure_no_key``.
    """

    def __init__(
        self,
        engine: EngineInterface,
        connection: redis.Redis,
        config: WorkerConfig,
        base_model: ModelIdentity,
    ):
        signing.require_key(config.audit_key, config.insecure_no_key)
        self.state = state = WorkerState(engine, connection, config, base_model)
        self.stopped = False
        self.lease = Lease(state)
        self.intake = Intake(state)
        self.publisher = Publisher(state, self.intake, self.lease, self._start_read)
        self.renewer = Renewer(state)  # lease and heartbeat on a thread of their own
        self._last = {"claim": 0.0, "heartbeat": 0.0, "unread": 0.0}
        self._drain_deadline: float | None = None
        self._away_since: float | None = None  # Redis unreachable since (monotonic)
        self._backoff_s = BACKOFF_S[0]
        self._saved_signals: dict[int, Any] = {}

    # what tests, benchmarks and the CLI read of it (the helpers get ``state``)
    engine = property(lambda self: self.state.engine)
    redis = property(lambda self: self.state.redis)
    config = property(lambda self: self.state.config)
    name = property(lambda self: self.state.name)
    consumer = property(lambda self: self.state.consumer)  # name#incarnation, in the group
    base_model = property(lambda self: self.state.base_model)
    keys = property(lambda self: self.state.keys)
    streams = property(lambda self: self.state.streams)
    held = property(lambda self: self.state.held)
    draining = property(lambda self: self.state.draining)
    metrics = property(lambda self: self.state.metrics)

    # --- the loop --------------------------------------------------------------

    def run(self) -> None:
        """Serve until stopped (burst: until the queue and the engine are empty)."""
        who = f"worker {self.name}"  # Redis away or full: wait, as the loop does
        until_redis_takes(
            lambda: claim_model(self.redis, self.keys, self.base_model), who, "claim the pool"
        )  # or ModelMismatchError
        warning = persistence_warning(self.redis)
        if warning:
            logger.warning("worker %s: %s", self.name, warning)
        warn_same_name(self.state)
        until_redis_takes(self.ensure_group, who, "create the consumer group")
        self._saved_signals = signals.install(self.on_signal)
        self.metrics.serve()
        logger.info("worker %s: serving %s", self.state.consumer, ", ".join(self.streams))
        try:
            while not self.stopped:
                self.run_guarded()
        finally:
            self.teardown()

    def run_guarded(self) -> None:
        """``run_once``, riding out Redis being away (a stall, a restart): never exits on it.

        The iteration that failed is repeated once Redis answers: a trip of
        chunks whose send failed is sent again before any other (see
        ``Publisher.flush``); a consumer group lost with a restart that kept no
        data is created again. A Redis out of memory (maxmemory, noeviction)
        refuses writes: the same as away, until an operator makes room.
        """
        try:
            self.run_once()
        except REDIS_DOWN as exc:
            self._redis_away(exc)
            return
        except redis.ResponseError as exc:
            if out_of_memory(exc):
                self._redis_away(exc, "is out of memory")
                return
            if "NOGROUP" in str(exc):
                logger.warning("worker %s: the consumer group is gone, creating it", self.name)
                self.ensure_group()
                return
            self._refused(exc)
            return
        if self._away_since is not None:
            logger.warning(
                "worker %s: Redis is back after %.1fs",
                self.name,
                time.monotonic() - self._away_since,
            )
            self._away_since, self._backoff_s = None, BACKOFF_S[0]

    def _refused(self, exc: redis.ResponseError) -> None:
        """Redis refused a call of the loop's own (not one request's: those fail alone,
        see ``start``, ``dead_letter`` and APPEND's results), say a pool key someone
        replaced with a value of another type (WRONGTYPE), an ACL that lost a right:
        logged with what Redis said, then the loop goes on after a backoff, as when Redis
        is away. A worker never exits on it: what it holds is renewed or returns to
        the pool after the lease, and the next iteration tries again."""
        logger.error(
            "worker %s: Redis refused a call (%s: %s); going on in %.1fs",
            self.name,
            type(exc).__name__,
            exc,
            self._backoff_s,
            exc_info=logger.isEnabledFor(logging.DEBUG),
        )
        self._redis_away(exc, "refused a call")

    def _redis_away(self, exc: Exception, what: str = "unreachable") -> None:
        if self._away_since is None:
            self._away_since = time.monotonic()
            logger.warning("worker %s: Redis %s (%s), retrying", self.name, what, exc)
        if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
            logger.warning("worker %s: stopping while Redis is away", self.name)
            self.stopped = True  # the entries it held return to others after the lease
            return
        time.sleep(self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, BACKOFF_S[1])

    def run_once(self) -> None:
        """One iteration: upkeep, admission, one engine step, publishing."""
        self.renewer.start()  # (once)
        idle = not self.engine.has_unfinished_requests()
        self.publisher.flush(wait=idle)  # all out before admission blocks on an idle engine
        self._upkeep()
        read = 0 if self.draining else self._admit()
        if self.engine.has_unfinished_requests():
            self._step()
        elif self.draining or (self.config.burst and read == 0 and self.intake.queue_empty()):
            self.publisher.flush(wait=True)
            self.stopped = True
        if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
            logger.warning(
                "worker %s: stopping, handing %s entries back", self.name, len(self.held)
            )
            self.hand_back()
            self.stopped = True

    def ensure_group(self) -> None:
        """Each job stream's ``workers`` group unless it exists; markers of the first
        layout moved once (``lifecycle.run_state``)."""
        for stream in self.streams:
            ensure_group(self.redis, stream, WORKERS_GROUP)
        run_state.migrate(self.redis, self.keys)

    # --- admission -------------------------------------------------------------

    def _admit(self) -> int:
        """Read new entries while the engine is idle (blocking up to ``block_ms``)."""
        if self.engine.has_unfinished_requests():
            return 0
        count = self.engine.capacity(self.config.read_ahead)
        if count == 0:
            return 0
        return self._start_read(self.intake.read(self.intake.plan(count), self.config.block_ms))

    def _start_read(self, entries: list) -> int:
        try:
            self.intake.new_read(entries)
            for stream, entry_id, fields, handed in entries:
                self.start(entry_id.decode(), fields, stream=stream, handed=handed)
        finally:  # renewed on only if held; Redis away mid-way: not started, claimed later
            for stream, entry_id, *_ in entries:
                self.state.leases.settle(stream, entry_id.decode())
        return len(entries)

    def start(
        self,
        entry_id: str,
        fields: dict,
        log: list[Chunk] | None = None,
        stream: str = "",
        handed: bool = False,
    ) -> None:
        """Put one delivered entry into the engine, or fail it alone with a clear error.

        Any exception but Redis being away (the loop rides that out) fails this
        request only: final error chunk, dead letter, audit record. ``stream``: the
        one it came from ('': the interactive one). A new entry (not ``handed`` by a
        peer, no ``log``) may go to a peer that holds its adapter (``Intake.hand_off``).
        """
        payload = (fields or {}).get(DATA.encode())
        held = None
        try:
            job = decode_job(payload, self.config.limits)
            running = self.held.get(job.request_id)
            if running is not None:
                if running.entry_id != entry_id:  # a second entry of a running request
                    why = f"entry {running.entry_id} runs it here"
                    dead_letter.ack_duplicate(
                        self.state, self.publisher, job.request_id, entry_id, stream, why
                    )
                return None
            if log and log[-1].finished:  # claimed, but its log already ends: answered
                why = "its chunk log already ends in a final chunk"
                dead_letter.ack_duplicate(
                    self.state, self.publisher, job.request_id, entry_id, stream, why
                )
                return None
            held = Held(entry_id, job, stream=stream)
            for chunk in log or []:
                held.take(chunk)
            held.resumed_tokens = held.total
            if not handed and log is None and self.intake.hand_off(held):
                return None
            add_to_engine(self.state, held)
        except REDIS_DOWN:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad job must not end the worker
            if held is not None:
                self.state.abort_in_engine(held.request_id)
            return dead_letter.refuse(
                self.state, self.publisher, entry_id, payload, exc, held, stream
            )
        self.state.hold(held)
        self.metrics.admitted(held)
        return None

    def _step(self) -> None:
        """One engine step and its chunks; a step that raises fails only its requests.
        However long it takes, the renewer keeps the lease and the heartbeat meanwhile."""
        self.state.in_step, start = True, time.monotonic()
        try:
            outputs, error = self.engine.step(), None
        except Exception as exc:  # noqa: BLE001 - the worker and the other requests go on
            outputs, error = [], exc
            logger.exception("worker %s: engine step failed", self.name)
        finally:
            self.state.in_step = False
            self.state.loop_at = time.monotonic()
        if error is not None:
            self._fail_step(f"engine step failed: {reason_of(error)}")
            return
        self.metrics.stepped(outputs, self.held)
        entries = self.intake.between_steps(self.state.loop_at - start)
        self.publisher.publish(outputs)  # queued before a start can meet Redis away
        if entries:
            self._start_read(entries)  # they run in the next step

    def _fail_step(self, reason: str) -> None:
        """Fail the requests the failed step held (all running ones), freeing their state."""
        self.publisher.flush(wait=True)  # their chunks so far, before their error chunks
        running = self.engine.running_request_ids()
        failed = [h for rid, h in self.held.items() if rid in running] or list(self.held.values())
        for held in failed:
            self.state.abort_in_engine(held.request_id)
            payload = encode_job(held.job)
            kind = ErrorKind.ENGINE  # the step's fault, not the request's
            dead_letter.dead_letter(
                self.state,
                self.publisher,
                held.entry_id,
                payload,
                reason,
                held,
                held.stream,
                kind=kind,
            )

    # --- upkeep ------------------------------------------------------------------

    def _due(self, what: str, every: float) -> bool:
        now = time.monotonic()
        if now - self._last[what] < every:
            return False
        self._last[what] = now
        return True

    def _upkeep(self) -> None:
        """The renewer's results (entries lost, vanished or asked to abort; the pool's
        live workers), claims, audit records of requests readers ended unread, the
        heartbeat record for the renewer. No Redis call of the lease or the heartbeat
        waits on this thread, nor for an engine step (``renewer.py``)."""
        self.state.loop_at = time.monotonic()
        self._apply_renewals()
        if self.state.vanished:
            dead_letter.fail_all_vanished(self.state, self.publisher)
        if not self.draining and self._due("claim", self.config.lease_s / 2):
            failover.claim(self.state, self.publisher, self.start)
        if self._due("unread", unread_audit.EVERY_S):  # requests readers asked to end
            unread_audit.record_ended(self.state)
        if self._due("heartbeat", self.config.heartbeat_s):
            record = heartbeat_record(self.state)
            self.renewer.beat(record)
            if not self.engine.has_unfinished_requests():
                self._apply_heartbeat(self._send_heartbeat(record))

    def _apply_renewals(self) -> None:
        for kind, *result in self.renewer.take():
            if kind == "lease":
                entries, (lost, flags, vanished) = result
                self.lease.apply(entries, lost, flags, vanished)
            else:
                self._apply_heartbeat(result[0])

    def renew(self, idle_ms: int = 0) -> None:
        """Renew the lease of every held entry; drop those lost; abort those asked to."""
        if self.held:
            held = list(self.held.values())
            self.lease.apply(held, *self.lease.send(held, idle_ms))

    def heartbeat(self) -> None:
        """The worker's record for ``status``, and ``{p}:alive:{name}``, which expires
        ``alive_ttl_s`` after the last heartbeat (a killed worker drops out of ``status``)."""
        self._apply_heartbeat(self._send_heartbeat(heartbeat_record(self.state)))

    def _send_heartbeat(self, record: Heartbeat) -> list[Heartbeat]:
        return send_heartbeat(self.redis, self.keys, record, self.config.alive_ttl_s)

    def _apply_heartbeat(self, live: list[Heartbeat]) -> None:
        self.intake.pool_seen(live)

    # --- shutdown ----------------------------------------------------------------

    def on_signal(self) -> None:
        """SIGTERM/SIGINT (``signals.py``): the first drains, the second hands entries
        back. Only flags: the loop acts on them between steps, never inside a Redis call."""
        if not self.state.draining:
            logger.info("worker %s: draining (again to hand entries back)", self.name)
            self.state.draining = True
            self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
        else:
            logger.info("worker %s: handing entries back", self.name)
            self._drain_deadline = 0.0  # the loop hands back and stops at once

    def hand_back(self) -> None:
        """Mark every held entry long idle so that another worker claims it at once
        (after the chunks of its last steps are in its log); the renewer renews none
        of them after that."""
        self.publisher.flush(wait=True)
        self.state.leases.clear()
        self.renew(idle_ms=self.config.lease_ms * 10)
        self.state.release_all()

    def teardown(self) -> None:
        signals.restore(self._saved_signals)
        self.renewer.close()
        try:
            if self.held:
                self.hand_back()
            self.redis.hdel(self.keys.workers, self.state.consumer)
            self.redis.delete(self.keys.alive(self.state.consumer))
        except (*REDIS_DOWN, redis.ResponseError) as exc:  # its entries return after the lease
            why = "stopped without saying so, Redis is away or refused"
            logger.warning("worker %s: %s (%s)", self.name, why, exc)
        self.publisher.close()
        self.metrics.close()
        logger.info("worker %s: stopped", self.name)
