"""Fast, honest failure while Redis is away.

``RedisWatch`` pings Redis every ``PING_EVERY_S`` on a connection of its own, each
ping bounded by ``PING_TIMEOUT_S``; from the first ping that fails until one answers,
Redis is *away*. ``RedisGate`` answers every route that needs Redis with 503 and
``Retry-After`` at once while it is (``/healthz``, the OpenAPI pages and ``/metrics``,
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
import logging
import time
from collections.abc import AsyncIterator

from starlette.responses import Response

from lorapool.connection import REDIS_DOWN, connect_async
from lorapool.gateway.errors import APIError

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
            await asyncio.sleep(PING_EVERY_S)

    async def outlasts(self, seconds: float) -> None:
        """Returns once Redis has been away ``seconds`` in a row."""
        while self.away_for() < seconds:
            left = seconds - self.away_for() if self.away else PING_EVERY_S
            await asyncio.sleep(max(PING_EVERY_S, left))

    def unavailable(self, seconds: float | None = None) -> APIError:
        """The 503 of Redis being away (for ``seconds``, when said)."""
        how_long = "" if seconds is None else f" for {seconds:g}s"
        return APIError(
            503,
            f"the queue (Redis) has not answered{how_long}; retry later",
            code="redis_unavailable",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    async def close(self) -> None:
        await self.client.aclose()


async def until_outage(
    items: AsyncIterator, watch: RedisWatch | None, outage_s: float
) -> AsyncIterator:
    """``items``; raises the 503 ``redis_unavailable`` once Redis has been away
    ``outage_s`` in a row while the next item was awaited. ``items`` is then closed in
    the background: what its closing does (an abort) waits for Redis, not the client."""
    if watch is None:
        async for item in items:
            yield item
        return
    gone = asyncio.ensure_future(watch.outlasts(outage_s))
    step = None
    try:
        while True:
            step = asyncio.ensure_future(items.__anext__())
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise watch.unavailable(outage_s)
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        gone.cancel()
        if step is not None and not step.done():
            step.cancel()
            task = asyncio.ensure_future(_close(step, items))
            watch.closing.add(task)  # a task runs to its end only while referenced
            task.add_done_callback(watch.closing.discard)
        else:
            await _close(None, items)


async def _close(step, items: AsyncIterator) -> None:
    try:
        if step is not None:
            await asyncio.gather(step, return_exceptions=True)
        await items.aclose()
    except REDIS_DOWN as exc:  # an abort on the way out, with Redis away
        logger.warning("a stream ended while Redis is away: %s", exc)


class RedisGate:
    """ASGI middleware: 503 at once on routes that need Redis while the app's
    ``RedisWatch`` says it is away (``/readyz``: not ready)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        watch = getattr(scope["app"].state, "redis_watch", None) if "app" in scope else None
        if scope["type"] != "http" or watch is None or not watch.away:
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path == "/metrics":  # what a scrape would find, without waiting for it
            return await Response(REDIS_DOWN_METRICS, media_type="text/plain")(scope, receive, send)
        if path.startswith(NEEDS_NO_REDIS):
            return await self.app(scope, receive, send)
        if path == "/readyz":
            return await _not_ready(watch)(scope, receive, send)
        return await watch.unavailable().response()(scope, receive, send)


def _not_ready(watch: RedisWatch):
    from lorapool.gateway.json import JSON

    reason = f"Redis is unreachable (no answer for {watch.away_for():.1f}s)"
    headers = {"Retry-After": str(watch.retry_after_s)}
    return JSON({"status": "not ready", "reason": reason}, status_code=503, headers=headers)
