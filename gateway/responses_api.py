"""OpenAI's Responses API: ``POST /v1/responses`` (streamed or not; background:
``responses_background``), ``GET`` and ``DELETE /v1/responses/{id}`` (its input items:
``responses_items``). A response is one chat job (``OpenAIServing.submit``),
its reply shaped by ``lorapool.openai.responses``; stored ones live in Redis
(``responses_store``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated

from fastapi import APIRouter, Request

from lorapool.gateway.auth import Principal, needs
from lorapool.gateway.body import read_body
from lorapool.gateway.edge import RIDES_OUTAGES
from lorapool.gateway.json import JSON
from lorapool.gateway.openai_api import HTTPDoor, held_stream, pool_of, serving_of, warned
from lorapool.gateway.pool import disconnected
from lorapool.gateway.responses_background import ended, settle_on_read, start_background
from lorapool.gateway.responses_store import ResponseStore
from lorapool.gateway.streams import sse
from lorapool.gateway.turns import end_turn
from lorapool.openai.bodies import openapi_body, parse
from lorapool.openai.response_bodies import ResponsesRequest
from lorapool.openai.response_events import ResponseEvents
from lorapool.openai.response_items import input_items
from lorapool.openai.responses import ResponseShape, replied, to_parsed

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])
Submitter = Annotated[Principal, needs("submit")]
Submitting = Annotated[Principal, needs("submit", submits=True)]  # check_rate


@router.post(
    "/responses",
    summary="A response (OpenAI's Responses API), run as a chat job",
    openapi_extra=openapi_body(ResponsesRequest),
)
async def create_response(request: Request, caller: Submitting):
    pool = pool_of(request)
    unknown: list[str] = []
    body = parse(await read_body(request, pool.config.body_limit), ResponsesRequest, unknown)
    store = ResponseStore(pool.producer.redis, pool.producer.keys, caller, input_items(body))
    previous = []
    if body.previous_response_id is not None:
        record = await store.load(body.previous_response_id, "previous_response_id")
        record = await settle_on_read(request, caller, store, record)
        previous = ended(record, "previous_response_id")["conversation"]
    serving = serving_of(request)
    parser, max_bytes = await serving.tool_parser(), pool.config.max_prompt_bytes
    parsed, conversation = to_parsed(body, previous, parser, max_bytes)
    parsed.ignored += unknown
    submitted = await serving.submit(parsed, "chat", caller, HTTPDoor(request, caller))
    end_turn(request)  # the wait for its tokens takes no turn (turns.py)
    chat_id = submitted.shape.id.removeprefix("chatcmpl-")
    shape = ResponseShape(body, chat_id, body.store is not False)
    saving = store if shape.store else None
    headers = warned(parsed, request)
    if body.background:
        return await start_background(
            request, store, shape, submitted.shape, submitted.handles, conversation,
            len(previous), headers,
        )  # fmt: skip
    if submitted.hold is None:
        setattr(request.state, RIDES_OUTAGES, True)  # Pool.results rides out a Redis outage
        response = shape.of_chat(await serving.reply(submitted, caller, disconnected(request)))
        if saving is not None:
            await saving.save(response, replied(conversation, response))
        return JSON(response, headers=headers)
    chunks = serving.events(submitted, caller, include_usage=True)
    events = _events(ResponseEvents(shape), chunks, saving, conversation)
    return held_stream(submitted.hold, events, headers)


async def _events(
    events: ResponseEvents, chunks: AsyncIterator[dict], store, conversation
) -> AsyncIterator[bytes]:
    """The response's SSE events (``event:`` its type) of the chat job's chunks; the
    response stored once complete, before its last events are sent."""
    for event in events.start():
        yield sse(event, event["type"])
    async with aclosing(chunks):
        async for chunk in chunks:
            if "error" in chunk:
                for event in events.failed(chunk["error"]):
                    yield sse(event, event["type"])
                return
            for event in events.feed(chunk):
                yield sse(event, event["type"])
    last = events.finish()
    if store is not None:  # before the last event: a client gone after it finds it stored
        await store.save(events.response, replied(conversation, events.response))
    for event in last:
        yield sse(event, event["type"])


@router.get("/responses/{response_id}", summary="A stored response")
async def get_response(response_id: str, request: Request, caller: Submitter) -> JSON:
    pool = pool_of(request)
    store = ResponseStore(pool.producer.redis, pool.producer.keys, caller)
    record = await settle_on_read(request, caller, store, await store.load(response_id))
    return JSON(record["response"])


@router.delete("/responses/{response_id}", summary="Delete a stored response")
async def delete_response(response_id: str, request: Request, caller: Submitter) -> JSON:
    pool = pool_of(request)
    await ResponseStore(pool.producer.redis, pool.producer.keys, caller).delete(response_id)
    return JSON({"id": response_id, "object": "response", "deleted": True})
