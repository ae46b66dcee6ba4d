"""The LoRA resolver: a model name no adapter is registered under, that names an adapter
directory under one of the gateway's ``--adapter-root``\\ s, is registered (its weights'
and config's hashes pinned, as ``lorapool adapters add`` does: docs/adapters.md) and
served on first use, as vLLM's filesystem resolver does.

On whenever the gateway has adapter roots; an ``admin`` key turns it off (and on) for
every gateway of the pool with ``POST /v1/lora_resolver {"enabled": false}`` (the flag
``{p}:lora-resolver``). Two gateways resolving one name at once register it once: the
registry's ``add`` is a WATCHed transaction, idempotent for the same path and files.
A name is looked up only as a direct child of a root (no ``.`` or ``..``; symlinks
leading out of the roots are refused by the registry).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Request
from msgspec import Struct

from lorapool.gateway.auth import Principal, needs
from lorapool.gateway.body import read_struct
from lorapool.gateway.json import JSON
from lorapool.openai.errors import APIError
from lorapool.producer.registry import WEIGHTS_FILE
from lorapool.records.adapter import AdapterRecord

router = APIRouter(prefix="/v1", tags=["adapter administration"])
Admin = Annotated[Principal, needs("admin")]
OFF = b"off"


class ResolverState(Struct, forbid_unknown_fields=True):
    """POST /v1/lora_resolver's body."""

    enabled: bool


async def enabled(pool) -> bool:
    """Resolving is on: the gateway has adapter roots and no admin turned it off."""
    if not pool.config.adapter_roots:
        return False
    return await pool.producer.redis.get(pool.producer.keys.lora_resolver) != OFF


def candidate(roots: tuple[str, ...], name: str) -> Path | None:
    """The first ``root/name`` that holds adapter weights (None: none does)."""
    if name in (".", ".."):
        return None
    for root in roots:
        path = Path(root).expanduser() / name
        if (path / WEIGHTS_FILE).is_file():
            return path
    return None


async def resolve(pool, name: str) -> AdapterRecord | None:
    """The registry record of adapter ``name``, registered now from an adapter root; None
    when the resolver is off or no root holds it."""
    if not await enabled(pool):
        return None
    path = await asyncio.to_thread(candidate, pool.config.adapter_roots, name)
    if path is None:
        return None
    try:  # hashes the weights: off the event loop
        return await asyncio.to_thread(pool.sync_registry().add, name, path)
    except ValueError:  # outside the roots after symlinks, or registered meanwhile elsewhere
        return await pool.view.adapter(name)


@router.get("/lora_resolver", summary="Whether unknown model names are resolved from disk")
async def resolver_state(request: Request, caller: Admin) -> JSON:
    pool = request.app.state.pool
    return JSON({"enabled": await enabled(pool), "roots": list(pool.config.adapter_roots)})


@router.post("/lora_resolver", summary="Turn the LoRA resolver on or off for the pool")
async def set_resolver(request: Request, caller: Admin) -> JSON:
    pool = request.app.state.pool
    body = await read_struct(request, 4096, ResolverState)
    if not pool.config.adapter_roots:
        raise APIError(409, "this gateway has no --adapter-root to resolve adapters from")
    key = pool.producer.keys.lora_resolver
    if body.enabled:
        await pool.producer.redis.delete(key)
    else:
        await pool.producer.redis.set(key, OFF)
    return JSON({"enabled": body.enabled, "roots": list(pool.config.adapter_roots)})
