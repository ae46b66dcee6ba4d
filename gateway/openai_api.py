"""OpenAI-compatible endpoints: ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (``model``: an adapter of the registry or the base model).

Non-streaming calls wait for each job's final output; ``stream=true`` sends OpenAI's
SSE chunks read from the jobs' chunk logs, ending with ``data: [DONE]``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from lorapool.gateway.auth import Principal, needs
from lorapool.gateway.body import read_body
from lorapool.gateway.edge import RIDES_OUTAGES
from lorapool.gateway.holds import Hold, holds_of
from lorapool.gateway.json import JSON
from lorapool.gateway.pool import Pool, disconnected
from lorapool.gateway.streams import DONE, sse
from lorapool.gateway.turns import end_turn
from lorapool.openai.bodies import ChatRequest, CompletionRequest, openapi_body
from lorapool.openai.errors import model_not_found
from lorapool.openai.params import Parsed
from lorapool.openai.serving import OpenAIServing

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])
Submitter = Annotated[Principal, needs("submit", submits=True)]  # check_rate


def pool_of(request: Request) -> Pool:
    return request.app.state.pool


@router.get("/models", summary="The base model and every registered adapter")
async def list_models(request: Request, caller: Annotated[Principal, needs()]) -> JSON:
    """OpenAI's model list: the pool's base model, then each adapter with ``parent`` (the
    base model), ``root`` (its path for admin keys, as vLLM's; its name for a tenant's
    key, which never sees a server path) and lorapool's ``adapter_id`` and ``sha256``."""
    view = pool_of(request).view
    base = await view.base_model()
    base_name = base.name if base else None
    data = []
    if base is not None:
        data.append(_model_card(base_name, None, base_name, sha256=base.sha256))
    for record in await view.adapters():
        if not caller.may_use(record.name):
            continue
        root = record.path if caller.sees_internals else record.name
        card = _model_card(record.name, base_name, root, sha256=record.sha256)
        card["adapter_id"] = record.id
        data.append(card)
    return JSON({"object": "list", "data": data})


@router.get("/models/{model_id}", summary="One model: the base model or an adapter")
async def retrieve_model(
    model_id: str, request: Request, caller: Annotated[Principal, needs()]
) -> JSON:
    """``/v1/models``' card of ``model_id`` (OpenAI's ``models.retrieve``); 404
    ``model_not_found`` for a name that is neither, or an adapter the key may not use."""
    view = pool_of(request).view
    base = await view.base_model()
    base_name = base.name if base else None
    if base is not None and model_id == base_name:
        return JSON(_model_card(base_name, None, base_name, sha256=base.sha256))
    record = await view.adapter(model_id) if caller.may_use(model_id) else None
    if record is None:
        raise model_not_found(model_id)
    root = record.path if caller.sees_internals else record.name
    card = _model_card(record.name, base_name, root, sha256=record.sha256)
    card["adapter_id"] = record.id
    return JSON(card)


def _model_card(name: str, parent: str | None, root: str, sha256: str | None) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "lorapool",
        "root": root,
        "parent": parent,
        "sha256": sha256,
    }


@router.post(
    "/completions",
    summary="Text completions (OpenAI's API)",
    openapi_extra=openapi_body(CompletionRequest),
)
async def completions(request: Request, caller: Submitter):
    return await _generate(request, "completion", caller)


@router.post(
    "/chat/completions",
    summary="Chat completions (OpenAI's API)",
    openapi_extra=openapi_body(ChatRequest),
)
async def chat_completions(request: Request, caller: Submitter):
    return await _generate(request, "chat", caller)


async def _generate(request: Request, kind: str, caller: Principal):
    serving = serving_of(request)
    parsed = await serving.parse(kind, await read_body(request, pool_of(request).config.body_limit))
    submitted = await serving.submit(parsed, kind, caller, HTTPDoor(request, caller))
    end_turn(request)  # the wait for its tokens takes no turn (turns.py)
    headers = warned(parsed, request)
    if submitted.hold is None:
        setattr(request.state, RIDES_OUTAGES, True)  # Pool.results rides out a Redis outage
        body = await serving.reply(submitted, caller, disconnected(request))
        return JSON(body, headers=headers)
    return held_stream(submitted.hold, _sse(serving.events(submitted, caller)), headers)


def serving_of(request: Request) -> OpenAIServing:
    return request.app.state.serving


class HTTPDoor:
    """An HTTP request's side of its submit (``serving.Door``): a stream's hold on the
    gateway's open streams (``holds.py``), and its key's rate limits' headers, which go
    on the answer (``edge.py``)."""

    __slots__ = ("request", "caller")

    def __init__(self, request: Request, caller: Principal):
        self.request, self.caller = request, caller

    def hold(self) -> Hold:
        return holds_of(self.request).take(self.caller.tenant)

    def rated(self, headers: dict[str, str] | None) -> None:
        if headers is not None:
            self.request.state.rate_headers = headers


def held_stream(hold: Hold, events: AsyncIterator[bytes], headers: dict) -> StreamingResponse:
    """The SSE response of ``events``, which gives its hold back when it ends."""
    return hold.stream(events, media_type="text/event-stream", headers={**headers, **NO_BUFFERING})


def warned(parsed: Parsed, request: Request) -> dict[str, str]:
    """The reply's header naming the parameters accepted and ignored, and their log line."""
    headers = serving_of(request).reply_headers(parsed)
    if headers:
        logger.warning("%s: ignored parameters %s", request.url.path, ", ".join(headers.values()))
    return headers


NO_BUFFERING = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """``events`` as SSE, ending with ``[DONE]``."""
    async with aclosing(events):
        async for event in events:
            yield sse(event)
    yield DONE
