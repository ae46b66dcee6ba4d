"""The pool's dashboard (``GET /dashboard``, read-only) and its Prometheus gauges
(``GET /metrics``), served by the gateway and by ``lorapool dashboard``.

With keys, the dashboard takes a key of role ``audit`` or ``admin``: in the
``Authorization`` header (a script), or through the page's form, which opens a session
(``dashboard_session.py``: a signed random token in an HttpOnly, SameSite=Strict cookie
that expires, never the key; a browser's meta refresh cannot send a header).
``/metrics`` takes the same keys (README: "the pool's gauges on /metrics and the
dashboard on /dashboard to audit and admin keys"): its series name tenants
(``lorapool_gateway_rate_limited_total{tenant}``); Prometheus scrapes it with an audit
key as its bearer token (``authorization.credentials_file``, deploy/README.md).
``lorapool dashboard`` (no keys: bind it locally) serves it to anyone.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from html import escape
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from lorapool.gateway.auth import Principal, authenticate, count, principal, unauthorized
from lorapool.gateway.dashboard_data import QueueHistory, sample_forever, snapshot
from lorapool.gateway.dashboard_page import render
from lorapool.gateway.dashboard_session import (
    COOKIE,
    WRONG_TRIES_PER_MINUTE,
    check_origin,
    cookie_header,
)
from lorapool.openai.errors import APIError
from lorapool.tasks import cancel_and_wait

router = APIRouter(tags=["operations"])
ROLES = ("audit", "admin")
LOGIN = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>lorapool dashboard</title></head><body><h1>lorapool dashboard</h1>
<p id="message">{message}</p><form method="post" action="/dashboard/login">
<label>API key (role audit or admin) <input name="key" type="password" autocomplete="off">
</label> <button>Open</button></form></body></html>"""


async def _caller(request: Request, counted: bool = True) -> Principal:
    """The caller by its key in the Authorization header (a script), or by the session
    its browser holds; APIError 401/403 as on every route, 429 past its key's requests
    per minute when ``counted`` (the page is; Prometheus's scrape of /metrics is not)."""
    pool = request.app.state.pool
    if not pool.config.auth or "authorization" in request.headers:
        return await authenticate(*ROLES, counted=counted)(request)
    cookie = request.cookies.get(COOKIE)
    key_id = await pool.sessions.key_id(cookie) if cookie else None
    record = await pool.view.api_key_by_id(key_id) if key_id else None
    if record is None:
        raise unauthorized("log in with an API key of role audit or admin")
    caller = principal(record, ROLES)
    if counted:
        await count(request, caller)
    return caller


def _login_page(message: str, status: int, headers: dict | None = None) -> HTMLResponse:
    return HTMLResponse(LOGIN.format(message=escape(message)), status_code=status, headers=headers)


@router.get("/dashboard", response_class=HTMLResponse, summary="The pool's dashboard (HTML)")
async def dashboard(request: Request) -> HTMLResponse:
    """Workers (stale heartbeats marked), the queue (with a sparkline), the audit
    backlog, errors and latency percentiles, hottest adapters, latest audit rows (their
    text only for keys that may read it) and dead letters; reloads itself every
    ``refresh`` seconds (default 5)."""
    try:
        caller = await _caller(request)
    except APIError as exc:
        return _login_page(exc.message, exc.status)
    refresh = request.query_params.get("refresh", "5")
    refresh_s = int(refresh) if refresh.isdigit() and 1 <= int(refresh) <= 3600 else 5
    snap = await snapshot(request.app.state, caller)
    links = getattr(request.app.state, "audit_links", True)
    page = render(snap, refresh_s, links, logout=caller.role is not None)
    return HTMLResponse(page, headers={"Cache-Control": "no-store"})


@router.post("/dashboard/login", include_in_schema=False)
async def login(request: Request) -> Response:
    """Checks the form's Origin, the client's tries, the key and its role; then a
    session cookie (never the key) and the dashboard."""
    pool = request.app.state.pool
    config = pool.config
    check_origin(request, config.trust_proxy, config.cors_origins)
    client = request.client.host if request.client else "-"
    tries = await pool.rates.take(f"login:{client}", WRONG_TRIES_PER_MINUTE, None, 1, 0)
    if not tries.taken:
        retry = tries.headers()["Retry-After"]
        message = f"too many login tries from this address; retry in {retry} s"
        return _login_page(message, 429, {"Retry-After": retry})
    body = await request.body()
    if len(body) > 4096:
        return _login_page("the form is too large", 413)
    key = parse_qs(body.decode("utf-8", "replace")).get("key", [""])[0].strip()
    record = await pool.view.api_key(key) if key else None
    if record is None:
        return _login_page("invalid API key", 401)
    if record.role not in ROLES:
        return _login_page(f"a key of role {record.role} may not open the dashboard", 403)
    response = RedirectResponse("/dashboard", status_code=303)
    cookie = await pool.sessions.create(record)
    secure = request.url.scheme == "https" or config.trust_proxy
    response.headers.append("set-cookie", cookie_header(cookie, config.session_ttl_s, secure))
    return response


@router.post("/dashboard/logout", include_in_schema=False)
async def logout(request: Request) -> Response:
    """Ends the browser's session (Origin checked: no page elsewhere logs it out)."""
    config = request.app.state.pool.config
    check_origin(request, config.trust_proxy, config.cors_origins)
    cookie = request.cookies.get(COOKIE)
    if cookie:
        await request.app.state.pool.sessions.delete(cookie)
    response = RedirectResponse("/dashboard", status_code=303)
    secure = request.url.scheme == "https" or config.trust_proxy
    response.headers.append("set-cookie", cookie_header("", 0, secure))
    return response


@router.get("/metrics", summary="The pool's gauges for Prometheus", include_in_schema=True)
async def metrics(request: Request) -> Response:
    """``lorapool exporter``'s gauges (queue length, pending, lag, dead letters, live
    workers, audit backlog), read from Redis now; and the gateway's HTTP metrics
    (``http_metrics.py``). Needs a key of role audit or admin (or a dashboard session)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    await _caller(request, counted=False)  # 401 / 403 as on every route; a cheap scrape

    body = await asyncio.to_thread(generate_latest, _registry(request.app))
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _registry(app: FastAPI):
    """One registry per app, its collector on a synchronous client (run in a thread)."""
    registry = getattr(app.state, "metrics_registry", None)
    if registry is None:
        from prometheus_client import CollectorRegistry

        from lorapool.connection import connect
        from lorapool.lifecycle.pool_metrics import PoolCollector

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
        await cancel_and_wait(task)


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
