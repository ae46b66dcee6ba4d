"""The audit writer: ``{p}:audit`` (consumer group ``audit``) into the audit tables.

Each batch is authenticated (every record must carry a worker's signature made with the
audit key for this pool, see ``lorapool.records.audit.sign_record``), parsed, stored in one
transaction (see store.py) and acked only after the commit. While the database is unreachable the
writer retries the same batch with exponential backoff, acks nothing and says so in its
log. An unsigned, wrongly signed or malformed record is moved to ``{p}:dead``
(a ``DeadLetter`` with the reason) and acked; a record the database rejects is found by
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

import redis
from sqlalchemy import Engine

from lorapool.audit_db import chaining, store
from lorapool.audit_db.database import is_current, migrate, with_stall_timeout
from lorapool.audit_db.guard import ChainGuard
from lorapool.audit_db.writer_batch import Item, NextBatch
from lorapool.audit_db.writer_config import WriterConfig, WriterStats
from lorapool.audit_db.writer_retry import REJECTED, RETRYABLE, Retrying, SchemaNotReady, Stopped
from lorapool.connection import ensure_group
from lorapool.lifecycle.keys import AUDIT_GROUP, Keys
from lorapool.records.audit import AuditRecord, RecordError, parse_record
from lorapool.records.dead_letter import AUDIT, DeadLetter

log = logging.getLogger(__name__)


class AuditWriter(Retrying):
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
        self.config = config or WriterConfig()
        self.engine = with_stall_timeout(engine, self.config.db_stall_timeout_s)
        self.views = Keys(self.config.prefix, self.config.shards).shard_views
        self.keys = self.views[0]  # the shard being read (steps take the shards in turn)
        self.stats = WriterStats()
        self.guard = ChainGuard(self.config.audit_key, self.config.checkpoint_policy())
        self._stopping = threading.Event()
        self._unrolled, self._rolled_at = 0, time.monotonic()  # rows since the rollup
        self._ahead: NextBatch | None = None  # the next batch, read while this one is stored
        self._retired: object = None  # the batch stored last, until the next one's work
        self._known: chaining.Known | None = None  # usage of its rows since the last refresh
        self._rollup_retry_at = 0.0  # after a failed refresh, not before this
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
        except Stopped:
            pass
        except store.ChainTampered as exc:
            log.error("audit writer %s: REFUSING TO WRITE: %s", name, exc)
            raise
        finally:  # a batch read ahead stays pending: the next start reads it again
            self._ahead = self._retired = None
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

    def _fetch(self, view: Keys, block: bool) -> tuple[list, list[Item], None]:
        """Read one batch of ``view``'s stream and parse it (invalid entries are
        dead-lettered on the way)."""
        entries = self._retry("read from Redis", self._next_entries, view, block)
        return entries, self._valid([self._parse(view, e) for e in entries]), None

    def _valid(self, items: list[Item]) -> list[Item]:
        """The items that parsed; the others are dead-lettered."""
        for item in items:
            if item.error is not None:
                self._dead_letter(item, item.error)
        return [item for item in items if item.error is None]

    def _prefetched(self, view: Keys) -> tuple[list, list[Item], chaining.Ahead | None] | None:
        """The batch read ahead while the last one was stored: parsed, and chained
        ahead where that could be done."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead.view is not view:  # not expected: read them again, they are still ours
            self._own_pending[ahead.view] = True
            return None
        ahead.finish()
        return ahead.entries, self._valid(ahead.items), ahead.early

    def _read_ahead(self, view: Keys) -> Callable[[], bool] | None:
        """Read ``view``'s next batch now (without waiting); returns the work that
        parses it a slice at a time, for the store to run while the server inserts.
        Not when the writer's own pending entries are due to be read again: they would
        include the batch in hand (``_next_entries`` reads them when nothing is)."""
        retired, self._retired = self._retired, None
        if self._own_pending[view] or time.monotonic() >= self._next_claim[view]:
            return None
        entries = self._retry("read from Redis", self._next_entries, view, False)
        if not entries:
            return None
        self._ahead = NextBatch(view, entries, self._parse, self.guard, retired)
        return self._ahead.work

    def _step(self, block: bool) -> int:
        view = self.keys
        entries, items, early = self._prefetched(view) or self._fetch(view, block)
        if not entries:
            if self.guard.heartbeat_due(time.time()):  # idle: a checkpoint at least daily
                self._retry("checkpoint", self._checkpoint)
            if self._unrolled and time.monotonic() >= self._rollup_retry_at:
                self._refresh_rollup()  # idle: the rollup catches up
            return 0
        meanwhile = None
        if self.config.prefetch:
            meanwhile = self._read_ahead(self.views[(self.views.index(view) + 1) % len(self.views)])
        self._keep_usage(early, self._store(items, meanwhile, early))
        if self.on_commit is not None:
            stored = [i.record for i in items if i.rows and not i.dead]
            self._retry("run on_commit", self.on_commit, stored)
        self._retry("ack in Redis", self._ack, view, [i.entry_id for i in items])
        self.stats.checkpoints = self.guard.num_made
        due = time.monotonic() - self._rolled_at >= self.config.rollup_interval_s
        many = self._unrolled >= self.config.rollup_rows
        if (many or (self._unrolled and due)) and time.monotonic() >= self._rollup_retry_at:
            self._refresh_rollup()
        self.stats.entries += len(entries)
        if self.config.prefetch:  # freed while the server inserts the next batch (NextBatch)
            self._retired = (entries, items, early)
        return len(entries)

    def _next_entries(self, view: Keys, block: bool) -> list:
        if self._own_pending[view]:
            entries = self._read(view, "0")
            self._own_pending[view] = bool(entries)
            if entries:
                return entries
        if time.monotonic() >= self._next_claim[view]:
            entries = self._read(view, "0") or self._claim(view)  # its own first: docstring
            if entries:
                return entries
        # with several shards, a blocking read waits on each in turn for its part
        block_ms = max(1, self.config.block_ms // len(self.views))
        return self._read(view, ">", block_ms if block else None)

    def _read(self, view: Keys, start: str, block_ms: int | None = None) -> list:
        reply = self.redis.xreadgroup(
            AUDIT_GROUP,
            self.config.consumer,
            {view.audit: start},
            count=self.config.batch_size,
            block=block_ms,
        )
        return reply[0][1] if reply else []

    def _claim(self, view: Keys) -> list:
        """Take over entries other consumers left pending too long (one scan of the PEL)."""
        while True:
            cursor, entries = self.redis.xautoclaim(
                view.audit,
                AUDIT_GROUP,
                self.config.consumer,
                self.config.claim_idle_ms,
                self._claim_cursor[view],
                count=self.config.batch_size,
            )[:2]
            self._claim_cursor[view] = cursor
            entries = [e for e in entries if e is not None and e[0] is not None]
            if entries:
                log.info(
                    "audit writer %s: claimed %d stale entries", self.config.consumer, len(entries)
                )
                return entries
            if cursor in ("0-0", b"0-0"):
                self._next_claim[view] = time.monotonic() + self.config.claim_every_s
                return []

    def _parse(self, view: Keys, entry) -> Item:
        """One entry as an item: its rows, or the ``error`` it is dead-lettered for
        (no I/O here: it runs while the store's COPY is open, see ``NextBatch``)."""
        entry_id, fields = entry
        payload = (fields or {}).get(b"data", (fields or {}).get("data"))
        if payload is None:
            return Item(view, entry_id, None, [], error="entry has no 'data' field")
        pool, key = self.config.prefix, self.config.audit_key
        source = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        try:
            record = parse_record(payload, key=key, pool=pool)
            rows = store.prepare(record, pool, source=source)
            return Item(view, entry_id, payload, rows, record)
        except RecordError as exc:
            return Item(view, entry_id, payload, [], error=str(exc))

    # --- storing, with retries and bisection -----------------------------------

    def _store(self, items: list[Item], meanwhile=None, early=None) -> bool:
        """Store the items' rows; rows the database rejects are dead-lettered.
        ``meanwhile``, ``early``: the next batch's work, these rows chained ahead
        (store.append). True when the rows went in as chained ahead."""
        rows = [row for item in items for row in item.rows]
        if not rows:
            return False
        try:
            result = self._retry(
                "write to the database",
                store.append,
                self.engine,
                rows,
                self.config.audit_key,
                self.guard,
                None,
                meanwhile,
                early,
            )
        except REJECTED as exc:
            if len(items) == 1:
                self._dead_letter(items[0], f"rejected by the database: {exc.orig}")
                return False
            middle = len(items) // 2
            self._store(items[:middle], meanwhile)
            self._store(items[middle:], meanwhile)
            return False
        self.stats.rows_written += result.written
        self._unrolled += result.written
        self.stats.duplicates += result.duplicates
        self.stats.chained_ahead += result.chained_ahead
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
        return result.chained_ahead

    def _keep_usage(self, early: chaining.Ahead | None, stored_ahead: bool) -> None:
        """Keep the usage of rows stored as chained ahead for the next refresh
        (chaining.Known); after any other batch the refresh reads the rows back."""
        if not stored_ahead or early is None:
            self._known = None
            return
        after, end = early.head.seq, early.chained[-1]["seq"]
        if self._known is None or not self._known.extend(after, end, early.usage):
            self._known = chaining.Known(after, end, dict(early.usage))

    def _refresh_rollup(self) -> None:
        """Bring the usage rollup up to date; when the database is away, try again
        later (usage adds the rows it does not cover, so nothing waits on it)."""
        known, self._known = self._known, None  # a failed refresh may have changed it
        try:
            store.refresh_rollup(self.engine, known)
        except RETRYABLE as exc:
            self.stats.db_retries += 1
            self._rollup_retry_at = time.monotonic() + self.config.backoff_max_s
            reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            name = self.config.consumer
            log.warning("audit writer %s: cannot refresh the usage rollup now: %s", name, reason)
            return
        self._unrolled, self._rolled_at = 0, time.monotonic()

    def _checkpoint(self) -> None:
        store.checkpoint_now(self.engine, self.config.audit_key, self.guard)
        self.stats.checkpoints = self.guard.num_made

    # --- Redis writes ----------------------------------------------------------

    def _ack(self, view: Keys, entry_ids: list) -> None:
        """Ack and delete committed entries: the table keeps them, Redis need not."""
        if entry_ids:
            pipe = self.redis.pipeline(transaction=True)
            pipe.xack(view.audit, AUDIT_GROUP, *entry_ids)
            pipe.xdel(view.audit, *entry_ids)
            pipe.execute()

    def _dead_letter(self, item: Item, reason: str) -> None:
        log.error(
            "audit writer %s: dead-lettering entry %s: %s",
            self.config.consumer,
            item.entry_id,
            reason,
        )
        entry, data = item.entry_id, item.payload or b""
        fields = DeadLetter(
            source=AUDIT,
            stream=item.view.audit,
            entry=entry.decode() if isinstance(entry, bytes) else entry,
            worker=self.config.consumer,
            reason=reason,
            data=data.encode() if isinstance(data, str) else data,
        ).fields()

        def move():
            pipe = self.redis.pipeline(transaction=True)
            dead, audit = item.view.dead, item.view.audit
            pipe.xadd(dead, fields, maxlen=self.config.dead_max_len, approximate=True)
            pipe.xack(audit, AUDIT_GROUP, item.entry_id)
            pipe.xdel(audit, item.entry_id)
            pipe.execute()

        self._retry("dead-letter an entry", move)
        item.dead = True
        self.stats.dead_lettered += 1
