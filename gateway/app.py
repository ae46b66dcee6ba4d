"""The ASGI application: routes, the pool made at startup, errors in OpenAI's shape.

FastAPI: typed routes, and the OpenAPI description of every endpoint at ``/docs``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from http import HTTPStatus

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from lorapool.connection import REDIS_DOWN, refusal
from lorapool.gateway import (
    adapters,
    audit,
    batches,
    dashboard,
    health,
    jobs,
    openai_api,
    resolver,
    responses_api,
    responses_background,
    responses_items,
    vllm_api,
)
from lorapool.gateway.audit_store import AuditStore
from lorapool.gateway.config import GatewayConfig
from lorapool.gateway.edge import Edge
from lorapool.gateway.holds import Holds
from lorapool.gateway.http_metrics import HttpMetrics
from lorapool.gateway.json import error_response
from lorapool.gateway.pool import Pool
from lorapool.gateway.request_stats import RequestStats
from lorapool.gateway.turns import Turns
from lorapool.openai.bodies import schema_components
from lorapool.openai.errors import APIError, job_lost
from lorapool.openai.serving import OpenAIServing, ServingConfig
from lorapool.producer import JobLost
from lorapool.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


def create_app(config: GatewayConfig) -> FastAPI:
    """The gateway for the pool of ``config`` (one Redis connection pool per app).

    ``app.state.begin_shutdown()`` (from any thread, e.g. a signal handler) ends every
    open job-events stream at once; OpenAI streams run on for the server's grace.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.pool = Pool(config)
        app.state.serving = OpenAIServing(app.state.pool, serving_config(config))
        await app.state.pool.ensure_groups()
        app.state.stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        app.state.begin_shutdown = lambda: loop.call_soon_threadsafe(app.state.stopping.set)
        app.state.audit = None
        if config.audit_db_url is not None:
            app.state.audit = AuditStore(
                config.audit_db_url, config.audit_db_schema, config.tenant_audit_internals
            )
        app.state.redis_watch = app.state.pool.watch
        watching = asyncio.create_task(app.state.redis_watch.run())
        try:
            async with dashboard.sampling(app):
                yield
        finally:
            await cancel_and_wait(watching)
            await responses_background.background_of(app).close()
            await app.state.pool.close()
            if app.state.audit is not None:
                app.state.audit.close()

    app = FastAPI(title="lorapool gateway", version="1", lifespan=lifespan)
    app.state.http_metrics = HttpMetrics()
    app.state.request_stats = RequestStats()
    app.state.holds = Holds(config.max_streams_per_tenant, config.max_streams)
    app.state.turns = Turns(config.turns_per_tenant)
    app.add_middleware(Edge, metrics=app.state.http_metrics)
    app.include_router(health.router)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(responses_items.router)
    app.include_router(responses_background.router)
    app.include_router(jobs.router)
    app.include_router(adapters.router)
    app.include_router(audit.router)
    app.include_router(batches.router)
    app.include_router(vllm_api.router)
    app.include_router(resolver.router)
    dashboard.install(app)
    _install_errors(app)
    _describe_bodies(app)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID"],
            expose_headers=["Location", "Retry-After"],
        )
    return app


def serving_config(config: GatewayConfig) -> ServingConfig:
    """The bounds OpenAI's routes hold a request to, from the gateway's options."""
    return ServingConfig(
        config.max_prompts,
        config.max_prompt_bytes,
        config.max_stop,
        config.tool_call_parser,
        config.max_backlog,
        config.retry_after_s,
        config.result_timeout_s,
        tuple(config.webhook_allow),
    )


def _describe_bodies(app: FastAPI) -> None:
    """The request bodies join the OpenAPI document's components (``openai.bodies``)."""
    generate = app.openapi

    def openapi() -> dict:
        document = generate()
        document.setdefault("components", {}).setdefault("schemas", {}).update(schema_components())
        return document

    app.openapi = openapi


def _install_errors(app: FastAPI) -> None:
    """Every 4xx and 5xx in OpenAI's error shape, FastAPI's and Starlette's own too (an
    unknown route, a wrong method, a body that does not validate, a bad multipart form,
    an unexpected exception: 500 without its details)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        path = request.url.path[:200]
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {path}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, message, None, code, exc.headers))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(
            APIError(500, "the gateway failed unexpectedly", code="internal_error")
        )

    @app.exception_handler(ClientDisconnect)
    async def left(request: Request, exc: ClientDisconnect):
        # a client gone while its body was read (an upload, a slow body cut): one debug
        # line, not a traceback; nobody reads the answer
        logger.debug("%s %s: the client left before its body was read", request.method,
                     request.url.path)  # fmt: skip
        return Response(status_code=499)

    @app.exception_handler(JobLost)
    async def lost(request: Request, exc: JobLost):
        return error_response(job_lost())  # (the internal request id is not a tenant's)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(APIError(400, first.get("msg", "invalid request"), param))

    @app.exception_handler(redis.ResponseError)
    async def refused(request: Request, exc: redis.ResponseError):
        message = refusal(exc)
        if message is None:
            raise exc
        logger.error("%s %s: %s", request.method, request.url.path, message)
        return error_response(APIError(503, message, code="redis_permission_denied"))

    for kind in REDIS_DOWN:

        @app.exception_handler(kind)
        async def redis_down(request: Request, exc: Exception):
            retry = str(request.app.state.pool.config.retry_after_s)
            return error_response(
                APIError(
                    503,
                    f"the queue is unreachable: {exc}",
                    code="redis_unavailable",
                    headers={"Retry-After": retry},
                )
            )
