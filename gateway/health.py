"""Operations: ``/healthz`` (the process answers) and ``/readyz`` (it can take requests).

Ready means the gateway reaches Redis, and its audit database when it serves one:
never whether a worker lives. A pool scaled to zero workers (KEDA's
``minReplicaCount: 0``) must keep its gateways ready, or nobody could submit the job
whose queue lag scales the workers up again. ``/readyz`` reports the live workers
that serve the base model in its ``workers`` field; ``/readyz?min_workers=N`` is 503
until at least N of them live (for a check that wants the pool serving, e.g. a smoke
test after a deploy).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request

from lorapool.connection import REDIS_DOWN
from lorapool.gateway.json import JSON
from lorapool.gateway.redis_watch import READY_DEADLINE_S
from lorapool.records.adapter import ModelIdentity
from lorapool.records.heartbeat import Heartbeat

router = APIRouter(tags=["operations"])
AUDIT_DB_TIMEOUT_S = 5.0


@router.get("/healthz", summary="The process is up")
async def healthz() -> JSON:
    return JSON({"status": "ok"})


@router.get(
    "/readyz",
    summary="Redis (and the audit database, if served) reachable; live workers reported",
)
async def readyz(
    request: Request,
    min_workers: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> JSON:
    view = request.app.state.pool.view
    try:  # within a second, whatever Redis does (gateway/redis_watch.py)
        base, workers = await asyncio.wait_for(_pool_state(view), READY_DEADLINE_S)
    except REDIS_DOWN as exc:
        return _not_ready(f"Redis is unreachable: {exc}")
    except asyncio.TimeoutError:
        return _not_ready(f"Redis did not answer within {READY_DEADLINE_S:g}s")
    problem = await _audit_db_problem(request.app.state.audit)
    if problem is not None:
        return _not_ready(f"the audit database is unreachable: {problem}")
    name = base.name if base else None
    serving = [w for w in workers if w.model == name and not w.draining]
    body = {"status": "ready", "model": name, "workers": len(serving)}
    if len(serving) < min_workers:
        reason = f"{len(serving)} live workers serve the base model {name!r}, {min_workers} asked"
        return _not_ready(reason, model=name, workers=len(serving))
    return JSON(body)


async def _pool_state(view) -> tuple[ModelIdentity | None, list[Heartbeat]]:
    await view.ping()
    return await view.base_model(), await view.live_workers()


async def _audit_db_problem(store) -> str | None:
    """None when there is no audit database or it answers ``SELECT 1``; else why not."""
    if store is None:
        return None
    try:
        await asyncio.wait_for(asyncio.to_thread(_select_one, store.engine), AUDIT_DB_TIMEOUT_S)
    except (asyncio.TimeoutError, TimeoutError):
        return f"no answer within {AUDIT_DB_TIMEOUT_S:g}s"
    except Exception as exc:  # noqa: BLE001 - any driver error means not reachable
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _select_one(engine) -> None:
    from sqlalchemy import text

    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))


def _not_ready(reason: str, **fields) -> JSON:
    return JSON({"status": "not ready", "reason": reason, **fields}, status_code=503)
