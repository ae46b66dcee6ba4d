"""``GET /v1/responses/{id}/input_items``: a stored response's input items, one page of
OpenAI's cursor list (``lorapool.openai.response_items.page``). Tenant-scoped as the
stored responses are: another tenant's id is a 404."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request

from lorapool.gateway.auth import Principal, needs
from lorapool.gateway.json import JSON
from lorapool.gateway.openai_api import pool_of
from lorapool.gateway.responses_store import ResponseStore
from lorapool.openai.response_items import page

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])
Submitter = Annotated[Principal, needs("submit")]


@router.get("/responses/{response_id}/input_items", summary="A stored response's input items")
async def list_input_items(response_id: str, request: Request, caller: Submitter) -> JSON:
    pool = pool_of(request)
    record = await ResponseStore(pool.producer.redis, pool.producer.keys, caller).load(response_id)
    return JSON(page(record.get("input_items", []), dict(request.query_params)))
