"""What the dashboard shows, read from Redis (and the audit database when there is one)
at each page load: workers, the queue, hottest adapters, latest audit rows, dead letters.

The queue's recent history (the sparkline) is sampled in the process, every
``SAMPLE_EVERY_S`` by ``sample_forever`` (a task of the app's lifespan) and at each page
load; ``HISTORY`` samples are kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from lorapool.gateway.auth import Principal
from lorapool.lifecycle.keys import AUDIT_GROUP, WORKERS_GROUP
from lorapool.lifecycle.pool_metrics import lag_of
from lorapool.records.dead_letter import decode_dead_letter
from lorapool.records.heartbeat import decode_heartbeats

logger = logging.getLogger(__name__)
SAMPLE_EVERY_S = 2.0
HISTORY = 300  # 10 minutes at one sample every 2 s
ROWS = 10  # audit rows and dead letters shown
HOT_WINDOW_S = 900  # hottest adapters: requests of the last 15 minutes
STALE_S = 5.0  # a heartbeat older than this is stale (workers beat every second)


@dataclass
class QueueHistory:
    """(time, length, lag) samples of the request stream, newest last."""

    samples: deque = field(default_factory=lambda: deque(maxlen=HISTORY))

    def add(self, now: float, length: int, lag: float) -> None:
        if not self.samples or now - self.samples[-1][0] >= SAMPLE_EVERY_S:
            self.samples.append((now, length, lag))


async def queue_state(pool) -> dict[str, Any]:
    """Length, pending, lag of the request stream, the batch stream's length, the dead
    letters' count and the audit backlog (every shard's together)."""
    state = {"length": 0, "pending": 0, "lag": 0.0, "dead": 0, "batch": 0, "audit_backlog": 0}
    for keys in pool.producer.keys.shard_views:
        for name, value in (await _shard_state(pool.producer.redis, keys)).items():
            state[name] += value
    return state


async def _shard_state(redis, keys) -> dict[str, Any]:
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.requests)
        pipe.xlen(keys.dead)
        pipe.xlen(keys.batch_requests)
        length, dead, batch = await pipe.execute()
    group = None
    if length:
        groups = await redis.xinfo_groups(keys.requests)
        group = next(
            (g for g in groups if g["name"] in (WORKERS_GROUP, WORKERS_GROUP.encode())), None
        )
    pending = 0 if group is None else int(group["pending"])
    lag = lag_of(group, length)
    backlog = await _audit_backlog(redis, keys)
    return {"length": length, "pending": pending, "lag": lag, "dead": dead, "batch": batch,
            "audit_backlog": backlog}  # fmt: skip


async def _audit_backlog(redis, keys) -> int:
    """Audit records no writer has committed yet: the ``audit`` group's lag and pending
    entries (the whole stream before a writer made the group)."""
    try:
        groups = await redis.xinfo_groups(keys.audit)
    except Exception:  # noqa: BLE001 - no stream yet
        return 0
    group = next((g for g in groups if g["name"] in (AUDIT_GROUP, AUDIT_GROUP.encode())), None)
    if group is None:
        return int(await redis.xlen(keys.audit))
    lag = group.get("lag")
    return int(group["pending"]) + (int(lag) if lag is not None else 0)


async def sample_forever(pool, history: QueueHistory) -> None:
    """Adds a queue sample every ``SAMPLE_EVERY_S`` until cancelled; Redis being away
    leaves a gap."""
    while True:
        try:
            queue = await queue_state(pool)
            history.add(time.time(), queue["length"], queue["lag"])
        except Exception as exc:  # noqa: BLE001 - a gap in the line, not a dead task
            logger.debug("dashboard: no queue sample (%s)", exc)
        await asyncio.sleep(SAMPLE_EVERY_S)


async def dead_letters(pool, count: int = ROWS) -> list[dict[str, str]]:
    """The newest dead letters: the entry given up on, who gave up (a worker, an audit
    writer), why."""
    redis, rows = pool.producer.redis, []
    letters = [
        letter
        for keys in pool.producer.keys.shard_views
        for letter in await redis.xrevrange(keys.dead, count=count)
    ]
    letters.sort(key=lambda letter: tuple(map(int, letter[0].split(b"-"))), reverse=True)
    for _, fields in letters[:count]:
        try:
            letter = decode_dead_letter(fields)
        except ValueError as exc:
            rows.append({"id": "?", "worker": "?", "reason": str(exc)})
            continue
        rows.append(
            {"id": letter.entry, "worker": letter.worker or letter.source, "reason": letter.reason}
        )
    return rows


def sees_everything(caller: Principal) -> bool:
    """The pool-wide panes (dead letters, usage of every tenant) are for admins, global
    auditors and an open (no-auth) deployment; a tenant's auditor sees its own rows."""
    return caller.role in (None, "admin") or caller.all_tenants


def reads_text(caller: Principal) -> bool:
    """Completion text is for auditors (of their tenant, or all) and an open deployment;
    an admin operates the pool and sees rows without their text."""
    return caller.role != "admin"


def _store_caller(caller: Principal) -> Principal:
    """Who the audit store answers for a pane: an admin asks as the pool (counts and ids
    of every tenant; its rows lose their text below), anyone else as itself."""
    return Principal(role="admin") if caller.role == "admin" else caller


async def latest_audit(store, caller: Principal, prefix: str, count: int = ROWS) -> list[dict]:
    """The newest audit rows of this pool (of the caller's tenant unless it sees all),
    without their text for a caller that may not read it."""
    since = time.time() - 3600
    rows, _ = await store.page(_store_caller(caller), {"pool": prefix, "since": since}, 1000, None)
    rows = list(reversed(rows[-count:]))
    if not reads_text(caller):
        rows = [{**r, "text": None} for r in rows]
    return rows


async def hottest(pool, store, caller: Principal, workers: list[dict]) -> list[dict[str, Any]]:
    """Adapters of the last 15 minutes from the audit trail, busiest first (requests,
    errors, latency p50/p95); without one (or for a tenant's auditor), the adapters the
    live workers hold now, by worker count."""
    if store is not None and sees_everything(caller):
        since = time.time() - HOT_WINDOW_S
        rows = await store.usage(_store_caller(caller), "adapter", since, None)
        rows = sorted(rows, key=lambda r: -r["requests"])[:ROWS]
        keep = ("requests", "errors", "latency_p50", "latency_p95")
        return [{"adapter": r["key"], **{k: r.get(k) for k in keep}} for r in rows]
    counts = Counter(name for w in workers for name in w.get("adapters", ()))
    return [{"adapter": name, "workers": n} for name, n in counts.most_common(ROWS)]


async def _audit_panes(pool, store, caller: Principal, workers: list[dict]) -> dict:
    """Hottest adapters and latest audit rows; an audit database that fails leaves a
    message in their place (the rest of the page still shows)."""
    try:
        rows = None if store is None else await latest_audit(store, caller, pool.config.prefix)
        return {"hottest": await hottest(pool, store, caller, workers), "audit": rows}
    except Exception as exc:  # noqa: BLE001 - any database error, shown on the page
        logger.warning("dashboard: the audit database failed: %s", exc)
        reason = getattr(exc, "message", None) or str(exc).splitlines()[0] if str(exc) else ""
        message = f"the audit database failed: {type(exc).__name__}: {reason}"[:300]
        return {"hottest": await hottest(pool, None, caller, workers), "audit": message}


async def workers_seen(pool) -> list[dict[str, Any]]:
    """Every heartbeat record, live or not: ``stale`` when its liveness flag expired or
    its last heartbeat is over ``STALE_S`` old (the page marks those)."""
    view, now = pool.view, time.time()
    records = decode_heartbeats(await view.redis.hgetall(view.keys.workers))
    alive = await view.redis.mget([view.keys.alive(n) for n in records]) if records else []
    return [
        {**h.to_dict(), "stale": flag is None or now - (h.updated or 0) > STALE_S}
        for h, flag in zip(records.values(), alive)
    ]


async def snapshot(app_state, caller: Principal) -> dict[str, Any]:
    """Everything one page shows, read now."""
    pool, store = app_state.pool, app_state.audit
    workers = await workers_seen(pool)
    queue = await queue_state(pool)
    now = time.time()
    app_state.queue_history.add(now, queue["length"], queue["lag"])
    everything = sees_everything(caller)
    stats = getattr(app_state, "request_stats", None)
    live = [w for w in workers if not w["stale"]]
    return {
        "now": now,
        "prefix": pool.config.prefix,
        "workers": workers,
        "queue": queue,
        "history": list(app_state.queue_history.samples),
        "requests": None if stats is None else stats.summary(now),
        "webhook_dead": await pool.view.redis.xlen(pool.view.keys.webhook_dead),
        **await _audit_panes(pool, store, caller, live),
        "text": reads_text(caller),
        "dead": await dead_letters(pool) if everything else None,
    }
