"""Adapter administration over HTTP, with vLLM's request bodies (role ``admin``, and
only when the gateway was started with ``--enable-adapter-admin``; otherwise 404):

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` registers an adapter
  as ``lorapool adapters add`` does (name rule, adapter roots, sha256 of its weights);
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` removes it from the registry.

Workers load registered adapters on demand; the path must be readable by them.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from lorapool.gateway.auth import Principal, require
from lorapool.gateway.body import read_json
from lorapool.gateway.json import JSON
from lorapool.openai.errors import APIError, bad_request, model_not_found
from lorapool.producer.registry import NameRefused
from lorapool.protocol import short_repr

router = APIRouter(prefix="/v1", tags=["adapter administration"])
Admin = Annotated[Principal, Depends(require("admin"))]


def _enabled(request: Request):
    pool = request.app.state.pool
    if not pool.config.adapter_admin:
        raise APIError(404, "adapter administration is off (--enable-adapter-admin)")
    return pool


async def _fields(request: Request, names: tuple[str, ...]) -> dict[str, Any]:
    body = await read_json(request, 64 << 10)
    if not isinstance(body, dict):
        raise bad_request(f"the body must be an object, got {short_repr(body)}", None)
    unknown = sorted(set(body) - set(names) - {"lora_int_id", "load_inplace"})
    if unknown:
        raise bad_request(f"unknown parameter {short_repr(unknown[0])}", str(unknown[0]))
    for name in names:
        if not isinstance(body.get(name), str) or not body[name]:
            raise bad_request(f"{name} must be a non-empty string", name)
    return body


@router.post("/load_lora_adapter", summary="Register an adapter (vLLM's body)")
async def load_lora_adapter(request: Request, caller: Admin) -> JSON:
    pool = _enabled(request)
    body = await _fields(request, ("lora_name", "lora_path"))
    registry = pool.sync_registry()
    try:  # reads the weights for their sha256: off the event loop
        record = await asyncio.to_thread(registry.add, body["lora_name"], body["lora_path"])
    except NameRefused as exc:
        raise bad_request(str(exc), "lora_name") from None
    except ValueError as exc:  # the folder: outside the roots, no weights, no config
        raise bad_request(str(exc), "lora_path") from None
    return JSON({"status": "loaded", "adapter": record.to_dict()})


@router.post("/unload_lora_adapter", summary="Remove an adapter from the registry")
async def unload_lora_adapter(request: Request, caller: Admin) -> JSON:
    pool = _enabled(request)
    body = await _fields(request, ("lora_name",))
    removed = await asyncio.to_thread(pool.sync_registry().remove, body["lora_name"])
    if not removed:
        raise model_not_found(body["lora_name"])
    return JSON({"status": "unloaded", "lora_name": body["lora_name"]})
