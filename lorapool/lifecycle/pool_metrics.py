"""The pool's gauges for Prometheus, read from Redis on each scrape (torch-free).

``PoolCollector`` is what ``lorapool exporter`` serves (and what a gateway can
register next to its own metrics). Each scrape reads, in one pipelined round
trip plus the two ``XINFO GROUPS``:

- ``lorapool_queue_length``: entries in ``{p}:requests`` (XLEN);
- ``lorapool_queue_pending``: delivered to a worker, not yet acknowledged;
- ``lorapool_queue_lag``: the ``workers`` group's lag as Redis reports it, the
  entries no worker has taken yet. NaN when Redis
  reports it unknown (an undelivered entry was deleted; lorapool never does);
- ``lorapool_batch_queue_length``, ``_pending``, ``_lag``: the same of the batch
  stream (``{p}:requests:batch``, read by workers only with capacity the
  interactive stream left);
- ``lorapool_queue_work``: the work in the pool, the autoscaling signal
  (docs/autoscaling.md): pending plus lag of both job streams, the jobs workers run now
  and those none has taken yet;
- ``lorapool_dead_letters``: entries in ``{p}:dead``;
- ``lorapool_workers_live``: workers whose liveness flag has not expired;
- ``lorapool_audit_backlog``: audit records not yet committed by a writer
  (the ``audit`` group's lag plus its pending entries);
- ``lorapool_webhook_attempts_total{outcome}`` and ``_attempt_seconds_total{outcome}``:
  webhook delivery attempts (``delivered``, ``failed``, ``refused``) and their time;
  ``lorapool_webhook_dead_letters``: deliveries that never succeeded;
  ``lorapool_webhook_tenants_busy``: tenants with deliveries waiting or in flight;
- ``lorapool_redis_up``: 0 when Redis did not answer (the others are then absent).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lorapool.lifecycle.keys import AUDIT_GROUP, WORKERS_GROUP, Keys

logger = logging.getLogger(__name__)


def group_info(connection: redis.Redis, stream: str, group: str) -> dict | None:
    """``XINFO GROUPS stream``'s record of ``group``; None when the stream or group is absent."""
    try:
        groups = connection.xinfo_groups(stream)
    except redis.ResponseError:  # no such key
        return None
    wanted = group.encode()
    return next((g for g in groups if g["name"] in (group, wanted)), None)


def lag_of(group: dict | None, length: int) -> float:
    """The group's lag (NaN when Redis says unknown); the whole stream without a group."""
    if group is None:
        return float(length)
    lag = group.get("lag")
    return math.nan if lag is None else float(lag)


class PoolCollector:
    """A custom collector: the pool-wide gauges of one key prefix, read on scrape."""

    def __init__(self, connection: redis.Redis, keys: Keys):
        self.redis = connection
        self.keys = keys

    def describe(self) -> list:
        return []  # collected on scrape only: registering must not call Redis

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            values = self.read()
        except redis.RedisError as exc:  # away, out of memory, refused: say so, do not fail
            logger.warning("exporter: Redis did not answer (%s)", exc)
            yield _gauge("lorapool_redis_up", "1 when Redis answered the scrape", 0)
            return
        yield _gauge("lorapool_redis_up", "1 when Redis answered the scrape", 1)
        for name, (doc, value) in values.items():
            yield _gauge(name, doc, value)
        try:
            yield from self._webhooks()
        except redis.RedisError as exc:  # a Redis user without these keys: the rest stands
            logger.warning("exporter: no webhook metrics (%s)", exc)

    def _webhooks(self) -> Iterator:
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.webhook_stats)
            pipe.xlen(self.keys.webhook_dead)
            pipe.scard(self.keys.webhook_tenants)
            stats, dead, busy = pipe.execute()
        stats = {k.decode(): float(v) for k, v in stats.items()}
        attempts = CounterMetricFamily(
            "lorapool_webhook_attempts", "webhook delivery attempts by outcome", labels=["outcome"]
        )
        seconds = CounterMetricFamily(
            "lorapool_webhook_attempt_seconds",
            "seconds spent in webhook attempts",
            labels=["outcome"],
        )
        for outcome in ("delivered", "failed", "refused"):
            attempts.add_metric([outcome], stats.get(outcome, 0.0))
            seconds.add_metric([outcome], stats.get(f"{outcome}_seconds", 0.0))
        yield attempts
        yield seconds
        yield _gauge(
            "lorapool_webhook_dead_letters", "webhook deliveries that never succeeded", dead
        )
        yield _gauge(
            "lorapool_webhook_tenants_busy", "tenants with webhook deliveries queued", busy
        )

    def read(self) -> dict[str, tuple[str, float]]:
        """Metric name -> (help, value), read from Redis now (summed over the shards)."""
        r, views = self.redis, self.keys.shard_views
        with r.pipeline(transaction=False) as pipe:
            pipe.hkeys(self.keys.workers)
            for view in views:
                for key in (view.requests, view.batch_requests, view.dead, view.audit):
                    pipe.xlen(key)
            names, *lengths = pipe.execute()
        queue, batch, dead, audit = (lengths[i::4] for i in range(4))
        backlog = sum(
            _backlog(group_info(r, view.audit, AUDIT_GROUP), length)
            for view, length in zip(views, audit)
        )
        streams = {
            **self._stream("queue", "", [v.requests for v in views], queue),
            **self._stream("batch_queue", "batch ", [v.batch_requests for v in views], batch),
        }
        work = sum(streams[f"lorapool_{n}_{c}"][1] for n in ("queue", "batch_queue")
                   for c in ("pending", "lag"))  # fmt: skip
        return {
            **streams,
            "lorapool_queue_work": ("jobs workers run now or none has taken yet", work),
            "lorapool_dead_letters": ("entries in the dead-letter stream", sum(dead)),
            "lorapool_workers_live": ("workers with a live heartbeat", self._live(names)),
            "lorapool_audit_backlog": ("audit records not yet committed to SQL", backlog),
        }

    def _stream(self, name: str, what: str, streams: list[str], lengths: list[int]) -> dict:
        """Length, pending and lag of a job stream, every shard's together (``what``: how
        its entries are called)."""
        groups = [group_info(self.redis, stream, WORKERS_GROUP) for stream in streams]
        return {
            f"lorapool_{name}_length": (f"{what}entries in the stream", sum(lengths)),
            f"lorapool_{name}_pending": (
                f"{what}entries delivered to a worker and not yet acknowledged",
                sum(0 if group is None else group["pending"] for group in groups),
            ),
            f"lorapool_{name}_lag": (
                f"{what}entries no worker has taken yet (the consumer group's lag; NaN: unknown)",
                sum(lag_of(group, length) for group, length in zip(groups, lengths)),
            ),
        }

    def _live(self, names: list[bytes]) -> int:
        if not names:
            return 0
        flags = self.redis.mget([self.keys.alive(n.decode()) for n in names])
        return sum(flag is not None for flag in flags)


def _backlog(group: dict | None, length: int) -> float:
    if group is None:
        return float(length)
    return lag_of(group, length) + group["pending"]


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
