"""Operations: ``/healthz`` (the process answers) and ``/readyz`` (Redis answers and at
least one live worker serves the pool's base model)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from lorapool.connection import REDIS_DOWN
from lorapool.gateway.json import JSON

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="The process is up")
async def healthz() -> JSON:
    return JSON({"status": "ok"})


@router.get("/readyz", summary="Redis reachable and a live worker for the base model")
async def readyz(request: Request) -> JSON:
    view = request.app.state.pool.view
    try:
        await view.ping()
        base = await view.base_model()
        workers = await view.live_workers()
    except REDIS_DOWN as exc:
        return _not_ready(f"Redis is unreachable: {exc}")
    name = base.get("name") if base else None
    serving = [w for w in workers if w.get("model") == name and not w.get("draining")]
    if not serving:
        return _not_ready(f"no live worker serves the base model {name!r}")
    return JSON({"status": "ready", "model": name, "workers": len(serving)})


def _not_ready(reason: str) -> JSON:
    return JSON({"status": "not ready", "reason": reason}, status_code=503)
