"""The gateway's edge (gateway/edge.py) when Redis goes away under a request: a real
RedisWatch whose Redis is a closed port (its pings fail, as a stopped Redis's time out),
started once the request is inside the app. The oracle is the HTTP answer and whether
the handler ran on or was cancelled."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from lorapool.gateway.edge import RIDES_OUTAGES, Edge
from lorapool.gateway.http_metrics import HttpMetrics
from lorapool.gateway.redis_watch import RedisWatch
from lorapool.gateway.request_stats import RequestStats
from lorapool.tasks import cancel_and_wait


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _app(seen: dict) -> Starlette:
    async def stuck(request: Request):  # a Redis call that never answers
        try:
            await asyncio.Event().wait()
        finally:
            seen["stuck_ended"] = True

    async def riding(request: Request):  # waits for its results, riding the outage
        setattr(request.state, RIDES_OUTAGES, True)
        await asyncio.sleep(1.5)
        return JSONResponse({"rode": True})

    async def stream(request: Request):
        async def events():
            yield b"data: 1\n\n"
            await asyncio.sleep(1.5)
            yield b"data: 2\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route(f"/v1/{f.__name__}", f) for f in (stuck, riding, stream)]
    app = Starlette(routes=routes)
    app.add_middleware(Edge, metrics=HttpMetrics())
    app.state.redis_watch = RedisWatch(f"redis://127.0.0.1:{_closed_port()}/0")
    app.state.request_stats = RequestStats()
    return app


async def _call_while_redis_goes(path: str) -> tuple[httpx.Response, float, dict]:
    seen: dict = {}
    app = _app(seen)
    watch = app.state.redis_watch
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        start = time.monotonic()
        call = asyncio.ensure_future(client.get(path, timeout=10))
        await asyncio.sleep(0.2)  # inside the app, Redis still up as far as the watch knows
        assert not watch.away and not call.done()
        watching = asyncio.ensure_future(watch.run())
        try:
            response = await call
            seen["away"] = watch.away
        finally:
            await cancel_and_wait(watching)  # its wait_for may swallow one cancel
            await watch.close()
        await asyncio.sleep(0.05)  # the cut handler's cancellation runs
    return response, time.monotonic() - start, seen


def test_a_request_inside_when_redis_goes_gets_503_when_the_watch_notices():
    response, seconds, seen = asyncio.run(_call_while_redis_goes("/v1/stuck"))
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "redis_unavailable"
    assert seconds < 2.0, seconds
    assert seen.get("stuck_ended"), "the handler cut off was not cancelled"


@pytest.mark.parametrize("path", ["/v1/riding", "/v1/stream"])
def test_a_begun_stream_or_a_call_riding_the_outage_is_left_alone(path):
    response, seconds, seen = asyncio.run(_call_while_redis_goes(path))
    assert seen["away"]  # the watch had noticed, and the answer came all the same
    assert response.status_code == 200
    assert seconds >= 1.5
    assert response.text in ('{"rode":true}', "data: 1\n\ndata: 2\n\n")
