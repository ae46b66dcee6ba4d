"""How the audit writer waits out a database or Redis that is away: every call it
makes to either goes through :meth:`Retrying._retry`, with exponential backoff and a
log line now and then, until it succeeds, is refused, or the writer is stopped."""

from __future__ import annotations

import logging
import time

import redis
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from lorapool.audit_db import store
from lorapool.connection import REDIS_DOWN, out_of_memory
from lorapool.startup import why_waiting

log = logging.getLogger("lorapool.audit_db.writer")


class SchemaNotReady(RuntimeError):
    """The audit tables are missing or older than this code."""


# Errors that mean "the database is not reachable or not ready": retry.
RETRYABLE = (DBAPIError, PoolTimeout, store.ChainError, SchemaNotReady)
# Errors that mean "the database refuses these rows": bisect and dead-letter.
REJECTED = (IntegrityError, DataError)
REDIS_ERRORS = REDIS_DOWN  # a Redis Cluster's CLUSTERDOWN too: away, not refused


class Stopped(Exception):
    """The writer was asked to stop while it waited."""


class Retrying:
    """The retry loop of :class:`~.writer.AuditWriter` (its config, stats, stop event
    and ``ensure_group`` are the writer's)."""

    def _retry(self, what: str, fn, *args):
        """Call ``fn`` until it succeeds, backing off while the DB or Redis is down."""
        delay, attempts, since = self.config.backoff_initial_s, 0, time.monotonic()
        while True:
            try:
                result = fn(*args)
            except REJECTED:
                raise
            except (*RETRYABLE, *REDIS_ERRORS, redis.ResponseError) as exc:
                if isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc):
                    log.warning(  # Redis came back without its data: start the group again
                        "audit writer %s: the consumer group is gone, creating it",
                        self.config.consumer,
                    )
                    self._retry("create the consumer group", self.ensure_group)
                    continue
                # CLUSTERDOWN is a ResponseError too; a Redis at maxmemory refuses writes
                # (the consumer group at start-up) until an operator makes room
                if not isinstance(exc, RETRYABLE + REDIS_ERRORS) and not out_of_memory(exc):
                    raise
                attempts += 1
                self._log_failure(what, attempts, delay, exc)
                if self._stopping.wait(delay):
                    raise Stopped() from None
                delay = min(delay * 2, self.config.backoff_max_s)
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
        if not isinstance(exc, (redis.RedisError, *REDIS_ERRORS)):  # the database's
            self.stats.db_retries += 1
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        if out_of_memory(exc):  # redis-py keeps "OOM" only in the exception's type
            reason = f"Redis {why_waiting(exc)}: {reason}"
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
