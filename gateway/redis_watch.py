"""Fast, honest failure while Redis is away.

``RedisWatch`` pings Redis every ``PING_EVERY_S`` on a connection of its own, each
ping bounded by ``PING_TIMEOUT_S``; from the first ping that fails until one answers,
Redis is *away*. The gateway's edge (``edge.py``) answers every route that needs Redis
with 503 and ``Retry-After`` at once while it is (``/healthz``, the OpenAPI pages and ``/metrics``,
which reports ``lorapool_redis_up 0``, still answer); ``/readyz`` asks Redis within
``READY_DEADLINE_S``. A request that meets a stall before the watch notices it gets
its 503 when its own Redis call times out (``GatewayConfig.redis_timeout_s``, each
call retried ``redis_retries`` times): within ``GatewayConfig.request_bound_s``.

What was already under way when Redis went away waits for it to come back, up to
``redis_outage_s`` (30 s): a job-events stream, an OpenAI stream or a call waiting for
its result then goes on as if nothing happened (the chunk logs make it exact); past it,
a stream ends with an error event (``type: service_unavailable``, ``code:
redis_unavailable``) and a waiting call gets that 503. A job-events client reconnects
later with ``Last-Event-ID`` and gets the rest exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from lorapool.connection import REDIS_DOWN, connect_async
from lorapool.lifecycle.marker import RedisAway
from lorapool.tasks import cancel_and_wait

logger = logging.getLogger(__name__)
PING_EVERY_S = 0.25
PING_TIMEOUT_S = 0.5
READY_DEADLINE_S = 1.0
NEEDS_NO_REDIS = ("/healthz", "/docs", "/redoc", "/openapi.json", "/version")
REDIS_DOWN_METRICS = (
    "# HELP lorapool_redis_up 1 when Redis answered the scrape\n"
    "# TYPE lorapool_redis_up gauge\nlorapool_redis_up 0.0\n"
)


class RedisWatch:
    """Whether Redis answers now, and since when it has not."""

    def __init__(self, url: str, retry_after_s: int = 1):
        self.client = connect_async(
            url, 0, max_connections=2, socket_timeout=PING_TIMEOUT_S,
            socket_connect_timeout=PING_TIMEOUT_S, pool_timeout=PING_TIMEOUT_S,
        )  # fmt: skip
        self.retry_after_s = retry_after_s
        self.away_since: float | None = None
        self.closing: set[asyncio.Future] = set()  # streams closing in the background
        self._waiters: dict[asyncio.Future, float] = {}  # outlasts(): future -> seconds

    @property
    def away(self) -> bool:
        return self.away_since is not None

    def away_for(self) -> float:
        return 0.0 if self.away_since is None else time.monotonic() - self.away_since

    async def run(self) -> None:
        """Ping until cancelled."""
        while True:
            try:
                await asyncio.wait_for(self.client.ping(), PING_TIMEOUT_S)
                up = True
            except Exception as exc:  # noqa: BLE001 - whatever it is, Redis did not answer
                up, reason = False, exc
            if up and self.away:
                logger.warning("Redis answers again after %.1fs", self.away_for())
                self.away_since = None
            elif not up and not self.away:
                why = f"{type(reason).__name__}: {reason}".rstrip(": ")
                logger.warning("Redis does not answer (%s): 503 until it does", why)
                self.away_since = time.monotonic()
            self._wake()
            await asyncio.sleep(PING_EVERY_S)

    def _wake(self) -> None:
        """Resolves the ``outlasts`` waits whose time has come (none while Redis answers:
        nothing runs per waiting request until then)."""
        if self.away and self._waiters:
            away_for = self.away_for()
            for future, seconds in list(self._waiters.items()):
                if away_for >= seconds and not future.done():
                    future.set_result(None)

    def when_away(self, seconds: float = 0.0) -> asyncio.Future:
        """A future resolved once Redis has been away ``seconds`` in a row (as the next
        ping after that finds it: within ``PING_EVERY_S``); ``forget`` it when done. The
        watch's loop resolves it: a waiter costs nothing per ping while Redis answers."""
        future = asyncio.get_running_loop().create_future()
        self._waiters[future] = seconds
        self._wake()
        return future

    def forget(self, future: asyncio.Future) -> None:
        self._waiters.pop(future, None)
        future.cancel()

    async def outlasts(self, seconds: float) -> None:
        """Returns once Redis has been away ``seconds`` in a row (``when_away``)."""
        future = self.when_away(seconds)
        try:
            await future
        finally:
            self.forget(future)

    def unavailable(self, seconds: float | None = None) -> RedisAway:
        """Redis being away (for ``seconds``, when said), as a fact: the HTTP layer
        answers it with 503 ``redis_unavailable`` (``admission.redis_unavailable``)."""
        return RedisAway(seconds, self.retry_after_s)

    async def close(self) -> None:
        await self.client.aclose()


async def until_outage(
    items: AsyncIterator, watch: RedisWatch | None, outage_s: float
) -> AsyncIterator:
    """``items``; raises ``RedisAway`` once Redis has been away
    ``outage_s`` in a row while the next item was awaited. ``items`` is then closed in
    the background: what its closing does (an abort) waits for Redis, not the client.

    One task a stream moves ``items`` into a queue that the watch's verdict also goes
    into: racing each item against the watch with a task and ``asyncio.wait`` of its own
    cost 14 µs a chunk (``until_outage`` over a local queue, 50,000 items), this 1-2.
    The queue holds at most ``BUFFERED`` items: a client that reads slowly slows the
    stream's reads from Redis instead of growing the gateway's memory."""
    if watch is None:
        async for item in items:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue(BUFFERED)
    pump = asyncio.ensure_future(_pump(items, queue))
    gone = watch.when_away(outage_s)
    gone.add_done_callback(lambda f: f.cancelled() or _put_outage(queue))
    ended = False
    try:
        while True:
            if queue.empty() and gone.done() and not gone.cancelled():
                raise watch.unavailable(outage_s)  # its verdict found the queue full
            item = await queue.get()
            if item is _END:
                ended = True
                return
            if item is _OUTAGE:
                raise watch.unavailable(outage_s)
            if isinstance(item, _Failed):
                ended = True
                raise item.error
            yield item
    finally:
        watch.forget(gone)
        if ended:
            await asyncio.gather(pump, return_exceptions=True)
        else:  # the reader left, or Redis did: the pump and items end in the background
            pump.cancel()
            task = asyncio.ensure_future(_close(pump, items))
            watch.closing.add(task)  # a task runs to its end only while referenced
            task.add_done_callback(watch.closing.discard)


_END, _OUTAGE = object(), object()
BUFFERED = 64  # items a stream's pump reads ahead of its client


def _put_outage(queue: asyncio.Queue) -> None:
    """The watch's verdict, unless the queue is full: its reader then has items to
    take, and finds the verdict once it has taken them (``until_outage``)."""
    with contextlib.suppress(asyncio.QueueFull):
        queue.put_nowait(_OUTAGE)


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


async def _pump(items: AsyncIterator, queue: asyncio.Queue) -> None:
    try:
        async for item in items:
            await queue.put(item)
    except Exception as exc:  # noqa: BLE001 - the reader raises it
        await queue.put(_Failed(exc))
    else:
        await queue.put(_END)


async def _close(pump, items: AsyncIterator) -> None:
    try:
        await cancel_and_wait(pump)
        await items.aclose()
    except REDIS_DOWN as exc:  # an abort on the way out, with Redis away
        logger.warning("a stream ended while Redis is away: %s", exc)


def not_ready(watch: RedisWatch):
    """``/readyz``'s answer while Redis is away."""
    from lorapool.gateway.json import JSON

    reason = f"Redis is unreachable (no answer for {watch.away_for():.1f}s)"
    headers = {"Retry-After": str(watch.retry_after_s)}
    return JSON({"status": "not ready", "reason": reason}, status_code=503, headers=headers)
