"""The gateway's edge: one pure-ASGI layer around every HTTP request that

- answers 503 with Retry-After at once while the app's ``RedisWatch`` says Redis is
  away, on every route that needs Redis (``/readyz``: not ready; ``/metrics``: what a
  scrape would find, ``lorapool_redis_up 0``; ``NEEDS_NO_REDIS`` routes still answer);
  and so does a request already in the app when the watch notices Redis going away,
  unless its answer has begun (a stream: ``until_outage`` handles it) or it waits for
  its results (``RIDES_OUTAGES`` in its state: ``Pool.results`` handles it). Its handler
  ends in the background. A request that meets a stall thus gets its 503 within the
  watch's noticing (``PING_EVERY_S`` + ``PING_TIMEOUT_S``), however many Redis calls it
  makes, each bounded by the socket timeout only as a backstop;
- adds the ``x-ratelimit-*`` headers a route's rate check left in the request's state
  (``OpenAIServing.check_rate``) to its answer;
- records the request in the HTTP metrics (``http_metrics.py``) and, for ``/v1/``
  requests, in the dashboard's recent requests (``request_stats.py``).

It was four middlewares, each wrapping ``send`` again: every SSE event of a stream
went through four more coroutine calls. Nothing is buffered: a stream's events pass
through as they come.
"""

from __future__ import annotations

import asyncio
import time

from starlette.responses import Response

from lorapool.gateway.http_metrics import OTHER, HttpMetrics
from lorapool.gateway.json import error_response
from lorapool.gateway.redis_watch import NEEDS_NO_REDIS, REDIS_DOWN_METRICS, not_ready
from lorapool.openai.admission import redis_unavailable
from lorapool.tasks import cancel_and_wait

RIDES_OUTAGES = "rides_redis_outages"  # set in a request's state: not cut off by the edge


class Edge:
    """The middleware (``app.add_middleware(Edge, metrics=...)``); the app's state holds
    ``redis_watch`` and ``request_stats`` once its lifespan has begun."""

    def __init__(self, app, metrics: HttpMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        app_state = scope["app"].state if "app" in scope else None
        path = scope["path"]
        stats = getattr(app_state, "request_stats", None) if path.startswith("/v1/") else None
        watch = getattr(app_state, "redis_watch", None)
        start = time.perf_counter()
        status, first, started = 500, None, False

        async def edge_sending(message):
            nonlocal status, first, started
            kind = message["type"]
            if kind == "http.response.start":
                status, started = message["status"], True
                extra = (scope.get("state") or {}).get("rate_headers")
                if extra:
                    added = [(k.lower().encode(), v.encode()) for k, v in extra.items()]
                    message = {**message, "headers": [*message.get("headers", ()), *added]}
            elif first is None and kind == "http.response.body":
                first = time.perf_counter() - start
            await send(message)

        def sending(message):  # the app's, unless the edge has answered for it
            if cut:
                return _nothing()
            # past the first body message there is nothing left to note: a stream's
            # events go to the server's send with no coroutine of ours around them
            return send(message) if first is not None else edge_sending(message)

        cut = False
        try:
            if watch is None or path.startswith(NEEDS_NO_REDIS):
                await self.app(scope, receive, sending)
            elif watch.away:
                await _gate(path, watch)(scope, receive, edge_sending)
            else:
                task = asyncio.ensure_future(self.app(scope, receive, sending))
                if not await _raced(task, watch, lambda: started, scope):
                    cut = True
                    await _gate(path, watch)(scope, receive, edge_sending)
        finally:
            total = time.perf_counter() - start
            handler = getattr(scope.get("route"), "path", None) or OTHER
            tenant = (scope.get("state") or {}).get("tenant")
            self.metrics.observe(handler, scope["method"], status, total, tenant)
            if stats is not None:
                stats.add(status, total if first is None else first, total)


async def _nothing() -> None:
    return None


async def _raced(task: asyncio.Future, watch, begun, scope) -> bool:
    """Whether ``task`` (the app on a request) ran to its end; False: Redis went away
    before its answer began, and it is cancelled (ending in the background)."""
    away = watch.when_away(0.0)
    try:
        await asyncio.wait((task, away), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.forget(away)
    if task.done() or begun() or (scope.get("state") or {}).get(RIDES_OUTAGES):
        await task
        return True
    task.cancel()
    ending = asyncio.ensure_future(cancel_and_wait(task))  # again, until it has ended
    for running in (task, ending):
        watch.closing.add(running)  # a task runs to its end only while referenced
        running.add_done_callback(_forgotten(watch.closing))
    return False


def _forgotten(closing: set):
    def done(task: asyncio.Future) -> None:
        closing.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a handler cut off may fail on its way out

    return done


def _gate(path: str, watch):
    """The answer of a route that needs Redis while it is away."""
    if path == "/metrics":  # what a scrape would find, without waiting for it
        return Response(REDIS_DOWN_METRICS, media_type="text/plain")
    if path == "/readyz":
        return not_ready(watch)
    return error_response(redis_unavailable(watch.unavailable()))
