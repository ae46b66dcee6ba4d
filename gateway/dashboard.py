"""The pool's dashboard (``GET /dashboard``, read-only) and its Prometheus gauges
(``GET /metrics``), served by the gateway and by ``lorapool dashboard``.

With keys, the dashboard takes a key of role ``audit`` or ``admin``: in the
``Authorization`` header, or in a cookie set by the page's form (a browser's meta
refresh cannot send a header). ``/metrics`` needs none, as Prometheus scrapes it: it
holds counts only.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from lorapool.gateway.auth import Principal, require
from lorapool.gateway.dashboard_data import QueueHistory, sample_forever, snapshot
from lorapool.gateway.dashboard_page import render
from lorapool.gateway.errors import APIError

router = APIRouter(tags=["operations"])
COOKIE = "lorapool_dashboard_key"
ROLES = ("audit", "admin")
LOGIN = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>lorapool dashboard</title></head><body><h1>lorapool dashboard</h1>
<p>{message}</p><form method="post" action="/dashboard/login">
<label>API key (role audit or admin) <input name="key" type="password" autocomplete="off">
</label> <button>Open</button></form></body></html>"""


async def _caller(request: Request) -> Principal:
    """The caller by header or cookie; APIError 401/403 as on every route."""
    check = require(*ROLES)
    if "authorization" not in request.headers and COOKIE in request.cookies:
        headers = [*request.scope["headers"]]
        headers.append((b"authorization", f"Bearer {request.cookies[COOKIE]}".encode()))
        request = Request({**request.scope, "headers": headers}, request.receive)
    return await check(request)


@router.get("/dashboard", response_class=HTMLResponse, summary="The pool's dashboard (HTML)")
async def dashboard(request: Request) -> HTMLResponse:
    """Workers, the queue (with a sparkline), hottest adapters, latest audit rows and
    dead letters; reloads itself every ``refresh`` seconds (default 5)."""
    try:
        caller = await _caller(request)
    except APIError as exc:
        page = LOGIN.format(message=exc.message.replace("<", "&lt;"))
        return HTMLResponse(page, status_code=exc.status)
    refresh = request.query_params.get("refresh", "5")
    refresh_s = int(refresh) if refresh.isdigit() and 1 <= int(refresh) <= 3600 else 5
    snap = await snapshot(request.app.state, caller)
    links = getattr(request.app.state, "audit_links", True)
    return HTMLResponse(render(snap, refresh_s, links), headers={"Cache-Control": "no-store"})


@router.post("/dashboard/login", include_in_schema=False)
async def login(request: Request) -> Response:
    """Sets the key cookie (HttpOnly, SameSite=Strict) and goes to the dashboard."""
    body = await request.body()
    if len(body) > 4096:
        raise APIError(413, "the form is too large")
    key = parse_qs(body.decode("utf-8", "replace")).get("key", [""])[0].strip()
    if not key:
        raise APIError(400, "give an API key", "key")
    response = RedirectResponse("/dashboard", status_code=303)
    response.set_cookie(COOKIE, key, httponly=True, samesite="strict")
    return response


@router.get("/metrics", summary="The pool's gauges for Prometheus", include_in_schema=True)
async def metrics(request: Request) -> Response:
    """``lorapool exporter``'s gauges (queue length, pending, lag, dead letters, live
    workers, audit backlog), read from Redis now; and the gateway's HTTP metrics
    (``http_metrics.py``)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    body = await asyncio.to_thread(generate_latest, _registry(request.app))
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _registry(app: FastAPI):
    """One registry per app, its collector on a synchronous client (run in a thread)."""
    registry = getattr(app.state, "metrics_registry", None)
    if registry is None:
        from prometheus_client import CollectorRegistry

        from lorapool.connection import connect
        from lorapool.pool_metrics import PoolCollector

        config = app.state.pool.config
        registry = CollectorRegistry()
        registry.register(
            PoolCollector(
                connect(config.redis_url, retries=0, **config.redis_options()),
                app.state.pool.producer.keys,
            )
        )
        if getattr(app.state, "http_metrics", None) is not None:  # the gateway's own
            registry.register(app.state.http_metrics)
        app.state.metrics_registry = registry
    return registry


def install(app: FastAPI) -> None:
    """The dashboard's routes and state on an app whose lifespan makes ``state.pool``
    and runs ``sampling(app)``."""
    app.state.queue_history = QueueHistory()
    app.include_router(router)


@asynccontextmanager
async def sampling(app: FastAPI):
    """The queue sampler of the sparkline, for the app's lifetime."""
    task = asyncio.create_task(sample_forever(app.state.pool, app.state.queue_history))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def create_dashboard_app(config) -> FastAPI:
    """``lorapool dashboard``: the dashboard and /metrics alone, over the pool of
    ``config`` (a GatewayConfig; auth off: it trusts its network, bind it locally)."""
    from lorapool.gateway.audit_store import AuditStore
    from lorapool.gateway.pool import Pool

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.pool = Pool(config)
        app.state.audit = None
        if config.audit_db_url is not None:
            app.state.audit = AuditStore(config.audit_db_url, config.audit_db_schema)
        try:
            async with sampling(app):
                yield
        finally:
            await app.state.pool.close()
            if app.state.audit is not None:
                app.state.audit.close()

    app = FastAPI(title="lorapool dashboard", lifespan=lifespan)
    app.state.audit_links = False  # no audit routes here
    install(app)
    return app
