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

from fastapi import APIRouter, Request
from msgspec import Meta, Struct

from lorapool.gateway.auth import Principal, needs
from lorapool.gateway.body import read_struct
from lorapool.gateway.json import JSON
from lorapool.openai.errors import APIError, bad_request, model_not_found
from lorapool.producer.registry import NameRefused

router = APIRouter(prefix="/v1", tags=["adapter administration"])
Admin = Annotated[Principal, needs("admin")]


def _enabled(request: Request):
    pool = request.app.state.pool
    if not pool.config.adapter_admin:
        raise APIError(404, "adapter administration is off (--enable-adapter-admin)")
    return pool


# the name's rule and the folder's are the registry's (``NameRefused``, ValueError)
Text = Annotated[str, Meta(min_length=1)]
MAX_BODY = 64 << 10


class UnloadAdapter(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's unload body; its ``lora_int_id`` and ``load_inplace`` are taken and unused
    (the registry names adapters and numbers them itself)."""

    lora_name: Text
    lora_int_id: Any = None
    load_inplace: Any = None


class LoadAdapter(UnloadAdapter, kw_only=True, forbid_unknown_fields=True):
    """vLLM's load body: the adapter's folder, readable by the workers."""

    lora_path: Text


@router.post("/load_lora_adapter", summary="Register an adapter (vLLM's body)")
async def load_lora_adapter(request: Request, caller: Admin) -> JSON:
    pool = _enabled(request)
    body = await read_struct(request, MAX_BODY, LoadAdapter)
    registry = pool.sync_registry()
    try:  # reads the weights for their sha256: off the event loop
        record = await asyncio.to_thread(registry.add, body.lora_name, body.lora_path)
    except NameRefused as exc:
        raise bad_request(str(exc), "lora_name") from None
    except ValueError as exc:  # the folder: outside the roots, no weights, no config
        raise bad_request(str(exc), "lora_path") from None
    return JSON({"status": "loaded", "adapter": record.to_dict()})


@router.post("/unload_lora_adapter", summary="Remove an adapter from the registry")
async def unload_lora_adapter(request: Request, caller: Admin) -> JSON:
    pool = _enabled(request)
    body = await read_struct(request, MAX_BODY, UnloadAdapter)
    removed = await asyncio.to_thread(pool.sync_registry().remove, body.lora_name)
    if not removed:
        raise model_not_found(body.lora_name)
    return JSON({"status": "unloaded", "lora_name": body.lora_name})
