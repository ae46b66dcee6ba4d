"""The audit writer: ``{p}:audit`` (consumer group ``audit``) into the audit tables.

Each batch is authenticated (every record must carry a worker's signature made with the
audit key for this pool, see ``lorapool.audit_record.sign_record``), parsed, stored in one
transaction (see store.py) and acked only after the commit. While the database is unreachable the
writer retries the same batch with exponential backoff, acks nothing and says so in its
log. An unsigned, wrongly signed or malformed record is moved to ``{p}:dead``
(``source=audit``, with the reason) and acked; a record the database rejects is found by
bisecting the batch and dead-lettered the same way. A record that contradicts the stored
row for its (pool, request, completion) is kept in the ``conflicts`` table and logged as
an error (``lorapool audit conflicts``). On start the writer first re-reads its own
pending entries, and again every ``claim_every_s`` (a read that redis-py retried after a
timeout may have been served, its reply lost), when it also claims entries that another
consumer left pending for ``claim_idle_ms``. Redelivery is harmless: rows are keyed by
(pool, request id, completion index), and an identical row is skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from sqlalchemy import Engine
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from lorapool.audit_db import store
from lorapool.audit_db.database import is_current, migrate
from lorapool.audit_db.guard import ChainGuard
from lorapool.audit_db.writer_config import WriterConfig, WriterStats
from lorapool.audit_record import AuditRecord, RecordError, parse_record
from lorapool.connection import REDIS_DOWN, ensure_group
from lorapool.lifecycle.keys import AUDIT_GROUP, Keys

log = logging.getLogger(__name__)


class SchemaNotReady(RuntimeError):
    """The audit tables are missing or older than this code."""


# Errors that mean "the database is not reachable or not ready": retry.
RETRYABLE = (DBAPIError, PoolTimeout, store.ChainError, SchemaNotReady)
# Errors that mean "the database refuses these rows": bisect and dead-letter.
REJECTED = (IntegrityError, DataError)
REDIS_ERRORS = REDIS_DOWN  # a Redis Cluster's CLUSTERDOWN too: away, not refused


@dataclass
class _Item:
    """One stream entry and the rows it became."""

    entry_id: bytes | str
    payload: bytes | str | None
    rows: list[store.PreparedRow]
    record: AuditRecord | None = None
    dead: bool = False


class _Stopped(Exception):
    pass


class AuditWriter:
    """Consumes ``{p}:audit`` into the audit database; see the module docstring.

    ``connection`` is a redis-py client; ``engine`` comes from
    ``create_audit_engine`` and may point at a database that is down (the
    writer waits for it). ``run(burst=True)`` returns once nothing is left.
    """

    def __init__(
        self,
        connection: redis.Redis,
        engine: Engine,
        config: WriterConfig | None = None,
        on_commit: Callable[[list[AuditRecord]], object] | None = None,
    ):
        """``on_commit``: called with the records of each batch once their rows are
        committed, before the batch is acked (completion callbacks; it must be
        idempotent: a batch is redelivered after a crash between the two)."""
        self.on_commit = on_commit
        self.redis = connection
        self.engine = engine
        self.config = config or WriterConfig()
        self.views = Keys(self.config.prefix, self.config.shards).shard_views
        self.keys = self.views[0]  # the shard being read (steps take the shards in turn)
        self.stats = WriterStats()
        self.guard = ChainGuard(self.config.audit_key, self.config.checkpoint_policy())
        self._stopping = threading.Event()
        self._own_pending = dict.fromkeys(self.views, True)
        self._claim_cursor = dict.fromkeys(self.views, "0-0")
        self._next_claim = dict.fromkeys(self.views, 0.0)

    # --- lifecycle -----------------------------------------------------------

    def stop(self) -> None:
        """Ask the writer to return after the batch in hand (thread- and signal-safe)."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def run(self, burst: bool = False) -> WriterStats:
        """Consume until :meth:`stop` (or, with ``burst``, until nothing is left)."""
        name = self.config.consumer
        log.info(
            "audit writer %s: consuming %s into %s",
            name,
            ", ".join(view.audit for view in self.views),
            self.engine.url.render_as_string(hide_password=True),
        )
        try:
            self._retry("create the consumer group", self.ensure_group)
            self._retry("check the database schema", self._check_schema)
            self._retry("check the chain", store.check_chain, self.engine, self.guard)
            idle = 0  # shards in a row that had nothing
            while not self.stopping:
                idle = 0 if self.step(block=not burst) else idle + 1
                if burst and idle >= len(self.views):
                    break
        except _Stopped:
            pass
        except store.ChainTampered as exc:
            log.error("audit writer %s: REFUSING TO WRITE: %s", name, exc)
            raise
        log.info("audit writer %s: stopped; %s", name, self.stats)
        return self.stats

    def ensure_group(self) -> None:
        """Create the ``audit`` consumer group (from the stream's start) of every shard's
        audit stream if missing."""
        for view in self.views:
            ensure_group(self.redis, view.audit, AUDIT_GROUP)

    def _check_schema(self) -> None:
        if self.config.migrate:
            migrate(self.engine)
        if not is_current(self.engine):
            raise SchemaNotReady(
                "the audit tables are not at the newest revision; run `lorapool audit migrate`"
            )
        if self.config.audit_key is None:
            with self.engine.connect() as conn:
                start = store.keyed_from(conn)
            if start is not None:
                raise store.KeyedChainError(
                    f"the audit chain is keyed from row {start} and this writer has no audit "
                    "key: refusing to write (set LORAPOOL_AUDIT_KEY or LORAPOOL_AUDIT_KEY_FILE)"
                )

    # --- one batch -----------------------------------------------------------

    def step(self, block: bool = True) -> int:
        """Read, store and ack one batch of one shard (the next shard's at the next
        step); returns the number of entries handled."""
        try:
            return self._step(block)
        finally:
            self.keys = self.views[(self.views.index(self.keys) + 1) % len(self.views)]

    def _step(self, block: bool) -> int:
        entries = self._retry("read from Redis", self._next_entries, block)
        if not entries:
            if self.guard.heartbeat_due(time.time()):  # idle: a checkpoint at least daily
                self._retry("checkpoint", self._checkpoint)
            return 0
        items = [item for item in map(self._parse, entries) if item is not None]
        self._store(items)
        if self.on_commit is not None:
            stored = [i.record for i in items if i.rows and not i.dead]
            self._retry("run on_commit", self.on_commit, stored)
        self._retry("ack in Redis", self._ack, [i.entry_id for i in items])
        self.stats.checkpoints = self.guard.num_made
        self.stats.entries += len(entries)
        return len(entries)

    def _next_entries(self, block: bool) -> list:
        if self._own_pending[self.keys]:
            entries = self._read("0")
            self._own_pending[self.keys] = bool(entries)
            if entries:
                return entries
        if time.monotonic() >= self._next_claim[self.keys]:
            entries = self._read("0") or self._claim()  # its own first: see the docstring
            if entries:
                return entries
        # with several shards, a blocking read waits on each in turn for its part
        block_ms = max(1, self.config.block_ms // len(self.views))
        return self._read(">", block_ms if block else None)

    def _read(self, start: str, block_ms: int | None = None) -> list:
        reply = self.redis.xreadgroup(
            AUDIT_GROUP,
            self.config.consumer,
            {self.keys.audit: start},
            count=self.config.batch_size,
            block=block_ms,
        )
        return reply[0][1] if reply else []

    def _claim(self) -> list:
        """Take over entries other consumers left pending too long (one scan of the PEL)."""
        while True:
            cursor, entries = self.redis.xautoclaim(
                self.keys.audit,
                AUDIT_GROUP,
                self.config.consumer,
                self.config.claim_idle_ms,
                self._claim_cursor[self.keys],
                count=self.config.batch_size,
            )[:2]
            self._claim_cursor[self.keys] = cursor
            entries = [e for e in entries if e is not None and e[0] is not None]
            if entries:
                log.info(
                    "audit writer %s: claimed %d stale entries", self.config.consumer, len(entries)
                )
                return entries
            if cursor in ("0-0", b"0-0"):
                self._next_claim[self.keys] = time.monotonic() + self.config.claim_every_s
                return []

    def _parse(self, entry) -> _Item | None:
        entry_id, fields = entry
        payload = (fields or {}).get(b"data", (fields or {}).get("data"))
        if payload is None:
            self._dead_letter(_Item(entry_id, None, []), "entry has no 'data' field")
            return None
        pool, key = self.config.prefix, self.config.audit_key
        source = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        try:
            record = parse_record(payload, key=key, pool=pool)
            return _Item(entry_id, payload, store.prepare(record, pool, source=source), record)
        except RecordError as exc:
            self._dead_letter(_Item(entry_id, payload, []), str(exc))
            return None

    # --- storing, with retries and bisection -----------------------------------

    def _store(self, items: list[_Item]) -> None:
        """Store the items' rows; rows the database rejects are dead-lettered."""
        rows = [row for item in items for row in item.rows]
        if not rows:
            return
        try:
            result = self._retry(
                "write to the database",
                store.append,
                self.engine,
                rows,
                self.config.audit_key,
                self.guard,
            )
        except REJECTED as exc:
            if len(items) == 1:
                self._dead_letter(items[0], f"rejected by the database: {exc.orig}")
                return
            middle = len(items) // 2
            self._store(items[:middle])
            self._store(items[middle:])
            return
        self.stats.rows_written += result.written
        self.stats.duplicates += result.duplicates
        self.stats.conflicts += len(result.conflicts)
        for conflict in result.conflicts:
            pool, request_id, index = conflict.row.key
            log.error(
                "audit writer %s: CONFLICT for pool %r request %r completion %d: entry %s "
                "differs from the stored row; kept in the conflicts table",
                self.config.consumer,
                pool,
                request_id,
                index,
                conflict.row.source,
            )

    def _checkpoint(self) -> None:
        store.checkpoint_now(self.engine, self.config.audit_key, self.guard)
        self.stats.checkpoints = self.guard.num_made

    def _retry(self, what: str, fn, *args):
        """Call ``fn`` until it succeeds, backing off while the DB or Redis is down."""
        delay, attempts, since = self.config.backoff_initial_s, 0, time.monotonic()
        while True:
            try:
                result = fn(*args)
            except REJECTED:
                raise
            except RETRYABLE + REDIS_ERRORS as exc:  # before ResponseError: CLUSTERDOWN is one
                attempts += 1
                self._log_failure(what, attempts, delay, exc)
                if self._stopping.wait(delay):
                    raise _Stopped() from None
                delay = min(delay * 2, self.config.backoff_max_s)
                continue
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning(  # Redis came back without its data: start the group again
                    "audit writer %s: the consumer group is gone, creating it",
                    self.config.consumer,
                )
                self._retry("create the consumer group", self.ensure_group)
                continue
            if attempts:
                log.warning(
                    "audit writer %s: could %s again after %d attempts (%.1fs)",
                    self.config.consumer,
                    what,
                    attempts,
                    time.monotonic() - since,
                )
            return result

    def _log_failure(self, what: str, attempts: int, delay: float, exc: Exception) -> None:
        if not isinstance(exc, REDIS_ERRORS):
            self.stats.db_retries += 1
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        level = logging.WARNING if attempts == 1 or attempts % 10 == 0 else logging.DEBUG
        log.log(
            level,
            "audit writer %s: cannot %s (attempt %d, nothing acked, retrying in %.1fs): %s",
            self.config.consumer,
            what,
            attempts,
            delay,
            reason,
        )

    # --- Redis writes ----------------------------------------------------------

    def _ack(self, entry_ids: list) -> None:
        """Ack and delete committed entries: the table keeps them, Redis need not."""
        if entry_ids:
            pipe = self.redis.pipeline(transaction=True)
            pipe.xack(self.keys.audit, AUDIT_GROUP, *entry_ids)
            pipe.xdel(self.keys.audit, *entry_ids)
            pipe.execute()

    def _dead_letter(self, item: _Item, reason: str) -> None:
        log.error(
            "audit writer %s: dead-lettering entry %s: %s",
            self.config.consumer,
            item.entry_id,
            reason,
        )
        fields = {
            "source": "audit",
            "stream": self.keys.audit,
            "id": item.entry_id,
            "reason": reason,
            "data": item.payload or b"",
        }

        def move():
            pipe = self.redis.pipeline(transaction=True)
            pipe.xadd(self.keys.dead, fields, maxlen=self.config.dead_max_len, approximate=True)
            pipe.xack(self.keys.audit, AUDIT_GROUP, item.entry_id)
            pipe.xdel(self.keys.audit, item.entry_id)
            pipe.execute()

        self._retry("dead-letter an entry", move)
        item.dead = True
        self.stats.dead_lettered += 1
