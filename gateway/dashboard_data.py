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
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.pool_metrics import lag_of

logger = logging.getLogger(__name__)
SAMPLE_EVERY_S = 2.0
HISTORY = 300  # 10 minutes at one sample every 2 s
ROWS = 10  # audit rows and dead letters shown
HOT_WINDOW_S = 900  # hottest adapters: requests of the last 15 minutes


@dataclass
class QueueHistory:
    """(time, length, lag) samples of the request stream, newest last."""

    samples: deque = field(default_factory=lambda: deque(maxlen=HISTORY))

    def add(self, now: float, length: int, lag: float) -> None:
        if not self.samples or now - self.samples[-1][0] >= SAMPLE_EVERY_S:
            self.samples.append((now, length, lag))


async def queue_state(pool) -> dict[str, Any]:
    """Length, pending, lag of the request stream, the batch stream's length and the
    dead letters' count (every shard's together)."""
    state = {"length": 0, "pending": 0, "lag": 0.0, "dead": 0, "batch": 0}
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
    return {"length": length, "pending": pending, "lag": lag, "dead": dead, "batch": batch}


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
    """The newest dead letters: entry id, worker, reason."""
    redis, rows = pool.producer.redis, []
    letters = [
        letter
        for keys in pool.producer.keys.shard_views
        for letter in await redis.xrevrange(keys.dead, count=count)
    ]
    letters.sort(key=lambda letter: tuple(map(int, letter[0].split(b"-"))), reverse=True)
    for entry_id, fields in letters[:count]:
        text = {k.decode(): v.decode("utf-8", "replace") for k, v in fields.items() if k != b"data"}
        rows.append({"id": entry_id.decode(), **text})
    return rows


def sees_everything(caller: Principal) -> bool:
    """The pool-wide panes (dead letters, usage of every tenant) are for admins, global
    auditors and an open (no-auth) deployment; a tenant's auditor sees its own rows."""
    return caller.role in (None, "admin") or caller.all_tenants


async def latest_audit(store, caller: Principal, prefix: str, count: int = ROWS) -> list[dict]:
    """The newest audit rows of this pool (of the caller's tenant unless it sees all)."""
    since = time.time() - 3600
    rows, _ = await store.search(caller, {"pool": prefix, "since": since}, 1000, None)
    return list(reversed(rows[-count:]))


async def hottest(pool, store, caller: Principal, workers: list[dict]) -> list[tuple[str, int]]:
    """(adapter, requests) of the last 15 minutes from the audit trail; without one (or
    for a tenant's auditor), the adapters the live workers hold now, by worker count."""
    if store is not None and sees_everything(caller):
        rows = await store.usage(caller, "adapter", time.time() - HOT_WINDOW_S, None)
        ranked = sorted(((r["key"], r["requests"]) for r in rows), key=lambda r: -r[1])
        return ranked[:ROWS]
    counts = Counter(name for w in workers for name in w.get("adapters", ()))
    return counts.most_common(ROWS)


async def _audit_panes(pool, store, caller: Principal, workers: list[dict]) -> dict:
    """Hottest adapters and latest audit rows; an audit database that fails leaves a
    message in their place (the rest of the page still shows)."""
    try:
        rows = None if store is None else await latest_audit(store, caller, pool.config.prefix)
        return {"hottest": await hottest(pool, store, caller, workers), "audit": rows}
    except Exception as exc:  # noqa: BLE001 - any database error, shown on the page
        logger.warning("dashboard: the audit database failed: %s", exc)
        message = f"the audit database failed: {type(exc).__name__}"
        return {"hottest": await hottest(pool, None, caller, workers), "audit": message}


async def snapshot(app_state, caller: Principal) -> dict[str, Any]:
    """Everything one page shows, read now."""
    pool, store = app_state.pool, app_state.audit
    workers = await pool.view.live_workers()
    queue = await queue_state(pool)
    now = time.time()
    app_state.queue_history.add(now, queue["length"], queue["lag"])
    everything = sees_everything(caller)
    return {
        "now": now,
        "prefix": pool.config.prefix,
        "workers": workers,
        "queue": queue,
        "history": list(app_state.queue_history.samples),
        **await _audit_panes(pool, store, caller, workers),
        "dead": await dead_letters(pool) if everything else None,
    }
