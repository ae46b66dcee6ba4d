"""The queue worker: one engine, fed from the ``workers`` consumer group.

Loop: periodic upkeep (lease renewal, claiming abandoned entries, heartbeat)
→ admit what the engine can take now → one engine step → one pipelined round
trip appending every advanced request's chunk (fenced, see ``scripts.py``).

Redis Cluster is not supported; use a standalone Redis (with replicas and
Sentinel for failover). Left as a documented limitation rather than
restructured: the atomicity the queue relies on spans keys of several hash
slots. Per-request keys (``{p}:job:{id}``, ``{p}:out:{id}``,
``{p}:abort:{id}``) share the slot of their ``{id}`` tag, but the shared
streams and hashes (``{p}:requests``, ``{p}:audit``, ``{p}:dead``,
``{p}:adapters``, ``{p}:adapter-ids``, ``{p}:workers``) each hash to a slot of
their own. A cluster refuses, with CROSSSLOT, these commands:

- ``APPEND`` (``scripts.py``) touches ``{p}:requests`` (XPENDING, XACK, XDEL),
  the request's ``out``, ``abort`` and ``job`` keys, ``{p}:audit`` and
  ``{p}:dead``: the final chunk, the ack and the audit record must be one
  atomic step, so it cannot be split per slot without losing that guarantee;
- the producer's ``SUBMIT_SCRIPT`` (``producer/job.py``): ``{p}:job:{id}`` and
  ``{p}:requests`` (the idempotency marker and the entry together);
- the registry's WATCH/MULTI over ``{p}:adapters`` and ``{p}:adapter-ids``;
- ``renew``'s EXISTS and ``failover.abort_flagged``'s MGET over the abort
  flags of many requests (these could be split per slot; the first two not).

``RENEW`` (``{p}:requests`` only), XREADGROUP and XAUTOCLAIM are single-slot.
Making it work would mean one hash tag for every key of a pool (a prefix such
as ``{lorapool}``, which ``Keys`` refuses today): that puts the whole pool on
one shard, which is a standalone Redis in all but name.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import orjson
import redis

from lorapool import signing
from lorapool.audit_db.record import record_from_output, sign_record
from lorapool.connection import ensure_group
from lorapool.keys import WORKERS_GROUP, Keys
from lorapool.outputs import RequestOutput
from lorapool.producer.registry import check_lora, decode_record
from lorapool.protocol import FieldError
from lorapool.wire import DATA, Chunk, decode_job, encode_chunk, encode_job
from lorapool.worker import failover
from lorapool.worker.config import WorkerConfig
from lorapool.worker.held import Held, engine_params, error_chunk, make_chunk, resumed_token_ids
from lorapool.worker.scripts import APPEND, RENEW

logger = logging.getLogger(__name__)
NOT_OWNER, DUPLICATE = -1, -2
BACKOFF_S = (0.1, 5.0)  # first and longest wait between tries while Redis is away
# Redis away: the run loop rides these out; every other error fails one request.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class ModelMismatchError(RuntimeError):
    """A worker's base model differs from the one its pool serves."""


def claim_model(connection: redis.Redis, keys: Keys, base_model: dict[str, str]) -> None:
    """Claim the pool for this base model, or refuse (ModelMismatchError) another one.

    The first worker of a pool records its model (``{p}:model``, SET NX); a
    worker whose weights differ would answer the pool's requests with another
    model, so it refuses to start, naming both.
    """
    mine = orjson.dumps(base_model)
    connection.set(keys.model, mine, nx=True)
    pool = orjson.loads(connection.get(keys.model) or mine)
    if pool.get("sha256") != base_model["sha256"]:
        raise ModelMismatchError(
            f"pool {keys.prefix!r} serves base model {pool.get('name')!r} "
            f"(sha256 {str(pool.get('sha256'))[:12]}…) and this worker has "
            f"{base_model['name']!r} (sha256 {base_model['sha256'][:12]}…): start it "
            f"on another --prefix, or delete {keys.model} once no worker of the old "
            "model runs"
        )


def _reason(exc: BaseException) -> str:
    """An exception as a dead letter's reason: its type unless it is a plain ValueError."""
    text = str(exc) or type(exc).__name__
    return text if type(exc) in (ValueError, FieldError) else f"{type(exc).__name__}: {text}"


class Worker:
    """Drives one ``LLMEngine`` from the request stream. ``base_model``: {"name", "sha256"}.

    Refuses to start (AuditKeyError) without an audit key to sign audit records
    with, unless ``config.insecure_no_key``.
    """

    def __init__(
        self, engine: Any, connection: redis.Redis, config: WorkerConfig, base_model: dict[str, str]
    ):
        signing.require_key(config.audit_key, config.insecure_no_key)
        self.engine = engine
        self.redis = connection
        self.config = config
        self.keys = Keys(config.prefix)
        self.name = config.name
        self.base_model = base_model
        self.held: dict[str, Held] = {}
        self.draining = False
        self.stopped = False
        self.num_tokens = 0
        self._append = connection.register_script(APPEND)
        self._renew = connection.register_script(RENEW)
        self._last = {"renew": 0.0, "claim": 0.0, "heartbeat": 0.0}
        self._drain_deadline: float | None = None
        self._unsent: list[tuple[Held, Chunk, bytes]] = []  # chunks of the last step
        self._away_since: float | None = None  # Redis unreachable since (monotonic)
        self._backoff_s = BACKOFF_S[0]
        self._saved_signals: dict[int, Any] = {}

    # --- the loop --------------------------------------------------------------

    def run(self) -> None:
        """Serve until stopped (burst: until the queue and the engine are empty)."""
        self.check_model()
        self.ensure_group()
        self._install_signals()
        logger.info("worker %s: serving %s", self.name, self.keys.requests)
        try:
            while not self.stopped:
                self.run_guarded()
        finally:
            self.teardown()

    def run_guarded(self) -> None:
        """``run_once``, riding out Redis being away (a stall, a restart): never exits on it.

        The iteration that failed is repeated once Redis answers: chunks not yet
        appended are sent again before the engine steps on (see ``_send``); a
        consumer group lost with a restart that kept no data is created again.
        """
        try:
            self.run_once()
        except REDIS_DOWN as exc:
            self._redis_away(exc)
            return
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            logger.warning("worker %s: the consumer group is gone, creating it", self.name)
            self.ensure_group()
            return
        if self._away_since is not None:
            logger.warning(
                "worker %s: Redis is back after %.1fs",
                self.name,
                time.monotonic() - self._away_since,
            )
            self._away_since, self._backoff_s = None, BACKOFF_S[0]

    def _redis_away(self, exc: Exception) -> None:
        if self._away_since is None:
            self._away_since = time.monotonic()
            logger.warning("worker %s: Redis unreachable (%s), retrying", self.name, exc)
        if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
            logger.warning("worker %s: stopping while Redis is away", self.name)
            self.stopped = True  # the entries it held return to others after the lease
            return
        time.sleep(self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, BACKOFF_S[1])

    def run_once(self) -> None:
        """One iteration: upkeep, admission, one engine step, publishing."""
        self._send()  # chunks of the last step that did not reach Redis
        self._upkeep()
        read = 0 if self.draining else self._admit()
        if self.engine.has_unfinished_requests():
            self._step()
        elif self.draining or (self.config.burst and read == 0 and self._queue_empty()):
            self.stopped = True
        if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
            logger.warning(
                "worker %s: stopping, handing %s entries back", self.name, len(self.held)
            )
            self.hand_back()
            self.stopped = True

    def ensure_group(self) -> None:
        """Create the ``workers`` consumer group (and the stream) unless it exists."""
        ensure_group(self.redis, self.keys.requests, WORKERS_GROUP)

    def check_model(self) -> None:
        """Refuse to serve a pool of another base model (see ``claim_model``)."""
        claim_model(self.redis, self.keys, self.base_model)

    def _queue_empty(self) -> bool:
        pending = self.redis.xpending(self.keys.requests, WORKERS_GROUP)
        return pending["pending"] == 0 and not self.held

    # --- admission -------------------------------------------------------------

    def capacity(self) -> int:
        """How many new requests the engine can take now (0 while some still wait)."""
        if self.engine.scheduler.waiting:
            return 0
        return max(0, self.engine.args.max_num_seqs - self.engine.get_num_unfinished_requests())

    def _admit(self) -> int:
        count = self.capacity()
        if count == 0:
            return 0
        block = None if self.engine.has_unfinished_requests() else self.config.block_ms
        reply = self.redis.xreadgroup(
            WORKERS_GROUP, self.name, {self.keys.requests: ">"}, count=count, block=block
        )
        entries = [e for _, stream_entries in reply or [] for e in stream_entries]
        for entry_id, fields in entries:
            self.start(entry_id.decode(), fields)
        return len(entries)

    def start(self, entry_id: str, fields: dict, log: list[Chunk] | None = None) -> None:
        """Put one delivered entry into the engine, or fail it alone with a clear error.

        Any exception but Redis being away (the loop rides that out) fails this
        request only: final error chunk, dead letter, audit record.
        """
        payload = (fields or {}).get(DATA.encode())
        held = None
        try:
            job = decode_job(payload, self.config.limits)
            if job.request_id in self.held:
                return None
            held = Held(entry_id, job)
            for chunk in log or []:
                held.take(chunk)
            held.resumed_tokens = held.total
            self._add_to_engine(held)
        except REDIS_DOWN:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad job must not end the worker
            if held is not None:
                self._abort_in_engine(held.request_id)
            return self.dead_letter(entry_id, payload, _reason(exc), held)
        self.held[job.request_id] = held
        return None

    def _add_to_engine(self, held: Held) -> None:
        job = held.job
        if job.lora_request is not None:
            record = decode_record(self.redis.hget(self.keys.adapters, job.lora_request.name))
            check_lora(job.lora_request, record)
            held.adapter = record
            self.engine.expect_lora_weights(job.lora_request, record["sha256"])
        if held.total and job.sampling_params.n > 1:
            raise ValueError(
                f"request {job.request_id}: cannot resume a request with n > 1 "
                f"after {held.total} tokens were streamed"
            )
        self.engine.add_request(
            job.request_id,
            job.engine_prompt,
            engine_params(job.sampling_params),
            arrival_time=job.arrival_time,
            lora_request=job.lora_request,
            resume_token_ids=resumed_token_ids(held),
        )

    def _step(self) -> None:
        """One engine step and its chunks; a step that raises fails only its requests."""
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the worker and the other requests go on
            logger.exception("worker %s: engine step failed", self.name)
            self._fail_step(f"engine step failed: {_reason(exc)}")
            return
        self._publish(outputs)

    def _fail_step(self, reason: str) -> None:
        """Fail the requests the failed step held (all running ones), freeing their state."""
        running = {seq.request.request_id for seq in self.engine.scheduler.running}
        failed = [h for rid, h in self.held.items() if rid in running] or list(self.held.values())
        for held in failed:
            self._abort_in_engine(held.request_id)
            self.dead_letter(held.entry_id, encode_job(held.job), reason, held)

    # --- publishing --------------------------------------------------------------

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Every advanced request's chunk, built once, then sent (see ``_send``)."""
        for out in outputs:
            held = self.held.get(out.request_id)
            if held is None:
                continue  # lost to another worker, or already failed
            chunk = make_chunk(held, out, self.name)
            self._unsent.append((held, chunk, self._final_audit(held, chunk)))
        self._send()

    def _send(self) -> None:
        """One pipelined round trip appending the unsent chunks, fenced.

        If Redis goes away, they stay unsent and the next iteration sends the
        same chunks again before the engine steps: a chunk whose first send did
        land comes back DUPLICATE (or, finished, NOT_OWNER: already acked).
        """
        if not self._unsent:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for held, chunk, audit in self._unsent:
                self._append_chunk(pipe, held, chunk, audit)
            results = pipe.execute()
        sent, self._unsent = self._unsent, []
        for (held, chunk, _), result in zip(sent, results):
            self._after_append(held, chunk, result)

    def _final_audit(self, held: Held, chunk: Chunk) -> bytes:
        """The audit record of a final chunk (every finished request, failed ones too)."""
        if not chunk.finished:
            return b""
        held.take(chunk)
        return orjson.dumps(self._audit_record(held))

    def _append_chunk(
        self,
        pipe,
        held: Held,
        chunk: Chunk,
        audit: bytes,
        dead: bytes | None = None,
        reason: str = "",
    ) -> None:
        rid = held.request_id
        self._append(
            keys=[
                self.keys.requests,
                self.keys.out(rid),
                self.keys.abort(rid),
                self.keys.job(rid),
                self.keys.audit,
                self.keys.dead,
            ],
            args=[
                WORKERS_GROUP,
                held.entry_id,
                self.name,
                chunk.seq,
                encode_chunk(chunk),
                int(chunk.finished),
                audit,
                held.job.result_ttl_s or self.config.result_ttl_s,
                dead or b"",
                reason,
                self.config.dead_max_len,
            ],
            client=pipe,
        )

    def _after_append(self, held: Held, chunk: Chunk, result: int) -> None:
        """Account an append. While this worker owns the entry, nobody else appends to
        its log, so DUPLICATE means this chunk already landed (a send repeated after a
        broken connection, by redis-py or by ``_send``)."""
        rid = held.request_id
        self.num_tokens += chunk.num_tokens
        if result == NOT_OWNER:
            if not chunk.finished:
                logger.warning("worker %s: lost %s to another worker, dropping it", self.name, rid)
            self._drop(rid)
        elif chunk.finished:
            self.held.pop(rid, None)
        else:
            held.take(chunk)
            if result == 1:
                self.engine.abort_request(rid)

    def _drop(self, request_id: str) -> None:
        self.held.pop(request_id, None)
        self.engine.abort_request(request_id)

    def _abort_in_engine(self, request_id: str) -> None:
        """Free whatever a request that failed half-way into the engine left there."""
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - it may never have got in
            logger.debug("worker %s: %s was not in the engine", self.name, request_id)

    def _audit_record(self, held: Held) -> dict[str, Any]:
        adapter = None
        if held.adapter is not None:
            keys = ("name", "id", "path", "sha256", "rank", "alpha", "target_modules", "base_model")
            adapter = {k: held.adapter.get(k) for k in keys}
        record = record_from_output(
            held.output,
            worker=self.name,
            base_model=self.base_model,
            adapter=adapter,
            sampling_params=held.job.sampling_params.to_dict(),
            metadata=held.job.metadata,
            error=held.output.error,
        )
        if self.config.audit_key is None:  # --insecure-no-key: the writer cannot check it
            return record
        return sign_record(record, self.config.audit_key, self.config.prefix)

    def dead_letter(
        self, entry_id: str, payload: bytes | None, reason: str, held: Held | None
    ) -> None:
        """Final error chunk (when the request is known), XACK and ``{p}:dead``, at once.

        Total: whatever the entry holds, it ends acknowledged and dead-lettered
        (only Redis being away raises). The dead letter keeps the payload only
        when no audit record keeps the prompt (see ``failover.dead_payload``).
        """
        logger.warning("worker %s: dead-lettering %s: %s", self.name, entry_id, reason)
        try:
            if held is None:
                held = failover.held_for_garbage(entry_id, payload, self.config.limits)
            if held is not None:
                self.held.pop(held.request_id, None)
                self._find_adapter(held)
                chunk = error_chunk(held, reason, self.name)
                dead = failover.dead_payload(payload, audited=True)
                with self.redis.pipeline(transaction=False) as pipe:
                    audit = self._final_audit(held, chunk)
                    self._append_chunk(pipe, held, chunk, audit, dead=dead, reason=reason)
                    pipe.execute()
                return
        except REDIS_DOWN:
            raise
        except Exception as exc:  # noqa: BLE001 - the dead-letter path must not raise
            logger.exception("worker %s: no error output for %s", self.name, entry_id)
            reason = f"{reason} (and its error output could not be written: {_reason(exc)})"
        self._append(
            keys=[
                self.keys.requests,
                self.keys.out("-"),
                self.keys.abort("-"),
                self.keys.job("-"),
                self.keys.audit,
                self.keys.dead,
            ],
            args=[
                WORKERS_GROUP,
                entry_id,
                self.name,
                -1,
                b"",
                1,
                b"",
                self.config.result_ttl_s,
                failover.dead_payload(payload, audited=False),
                reason,
                self.config.dead_max_len,
            ],
        )

    def _find_adapter(self, held: Held) -> None:
        """The registry record of a failed job's adapter, for its audit record, if it matches."""
        lora = held.job.lora_request
        if held.adapter is None and lora is not None:
            try:
                record = decode_record(self.redis.hget(self.keys.adapters, lora.name))
            except ValueError:  # a damaged registry record: audit the request without it
                return
            if record is not None and record.get("id") == lora.lora_int_id:
                held.adapter = record

    # --- upkeep ------------------------------------------------------------------

    def _due(self, what: str, every: float) -> bool:
        now = time.monotonic()
        if now - self._last[what] < every:
            return False
        self._last[what] = now
        return True

    def _upkeep(self) -> None:
        if self._due("renew", self.config.lease_s / 3):
            self.renew()
        if not self.draining and self._due("claim", self.config.lease_s / 2):
            failover.claim(self)
        if self._due("heartbeat", self.config.heartbeat_s):
            self.heartbeat()

    def renew(self, idle_ms: int = 0) -> None:
        """Renew the lease of every held entry; drop those lost; abort those asked to."""
        if not self.held:
            return
        held = list(self.held.values())
        lost = self._renew(
            keys=[self.keys.requests],
            args=[WORKERS_GROUP, self.name, idle_ms] + [h.entry_id for h in held],
        )
        lost = {x.decode() for x in lost}
        flags = self.redis.exists(*[self.keys.abort(h.request_id) for h in held])
        for h in held:
            if h.entry_id in lost:
                self._drop(h.request_id)
        if flags:
            failover.abort_flagged(self, held)

    def heartbeat(self) -> None:
        """The worker's record for ``status``, and ``{p}:alive:{name}``, which expires
        ``alive_ttl_s`` after the last heartbeat (a killed worker drops out of ``status``)."""
        now = time.time()
        elapsed = max(1e-6, now - self._last.get("tokens_at", now - 1))
        self._last["tokens_at"] = now
        record = {
            "name": self.name,
            "device": str(self.engine.args.resolve_device()),
            "model": self.base_model.get("name"),
            "updated": now,
            "running": len(self.engine.scheduler.running),
            "waiting": len(self.engine.scheduler.waiting),
            "held": len(self.held),
            "tokens_per_s": self.num_tokens / elapsed,
            "adapters": sorted(
                {h.job.lora_request.name for h in self.held.values() if h.job.lora_request}
            ),
            "draining": self.draining,
        }
        self.num_tokens = 0
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.workers, self.name, orjson.dumps(record))
            pipe.set(self.keys.alive(self.name), 1, ex=self.config.alive_ttl_s)
            pipe.execute()

    # --- shutdown ----------------------------------------------------------------

    def _install_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._saved_signals[signum] = signal.signal(signum, self._on_sigterm)

    def _restore_signals(self) -> None:
        for signum, handler in self._saved_signals.items():
            signal.signal(signum, handler)
        self._saved_signals.clear()

    def _on_sigterm(self, signum, frame) -> None:
        """Only flags: the loop acts on them between steps, never inside a Redis call."""
        if not self.draining:
            logger.info("worker %s: draining (again to hand entries back)", self.name)
            self.draining = True
            self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
        else:
            logger.info("worker %s: handing entries back", self.name)
            self._drain_deadline = 0.0  # the loop hands back and stops at once

    def hand_back(self) -> None:
        """Mark every held entry long idle so that another worker claims it at once."""
        self.renew(idle_ms=self.config.lease_ms * 10)
        self.held.clear()

    def teardown(self) -> None:
        self._restore_signals()
        try:
            if self.held:
                self.hand_back()
            self.redis.hdel(self.keys.workers, self.name)
            self.redis.delete(self.keys.alive(self.name))
        except REDIS_DOWN as exc:  # its entries return to others after the lease
            logger.warning(
                "worker %s: stopped without saying so, Redis is away (%s)", self.name, exc
            )
        logger.info("worker %s: stopped", self.name)
