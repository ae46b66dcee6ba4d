"""OpenAI-compatible endpoints: ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (``model``: an adapter of the registry or the base model).

Non-streaming calls wait for each job's final output; ``stream=true`` sends OpenAI's
SSE chunks read from the jobs' chunk logs, ending with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from lorapool.gateway.auth import Principal, require
from lorapool.gateway.body import read_body
from lorapool.gateway.edge import RIDES_OUTAGES
from lorapool.gateway.holds import Hold, holds_of
from lorapool.gateway.json import JSON
from lorapool.gateway.pool import Pool, disconnected
from lorapool.gateway.redis_watch import until_outage
from lorapool.gateway.streams import DONE, merged_chunks, sse, until_taken
from lorapool.openai.bodies import ChatRequest, CompletionRequest, openapi_body
from lorapool.openai.echo import Echo
from lorapool.openai.errors import APIError, job_lost, model_not_found
from lorapool.openai.format import Shape, fingerprint
from lorapool.openai.params import (
    IGNORED_HEADER,
    Parsed,
    ignored_header,
    parse_chat,
    parse_completion,
)
from lorapool.producer import JobLost

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])
Submitter = Annotated[Principal, Depends(require("submit", counted=False))]  # check_rate


def pool_of(request: Request) -> Pool:
    return request.app.state.pool


@router.get("/models", summary="The base model and every registered adapter")
async def list_models(request: Request, caller: Annotated[Principal, Depends(require())]) -> JSON:
    """OpenAI's model list: the pool's base model, then each adapter with ``parent`` (the
    base model), ``root`` (its path for admin keys, as vLLM's; its name for a tenant's
    key, which never sees a server path) and lorapool's ``adapter_id`` and ``sha256``."""
    view = pool_of(request).view
    base = await view.base_model()
    base_name = base["name"] if base else None
    data = []
    if base is not None:
        data.append(_model_card(base_name, None, base_name, sha256=base.get("sha256")))
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
    model_id: str, request: Request, caller: Annotated[Principal, Depends(require())]
) -> JSON:
    """``/v1/models``' card of ``model_id`` (OpenAI's ``models.retrieve``); 404
    ``model_not_found`` for a name that is neither, or an adapter the key may not use."""
    view = pool_of(request).view
    base = await view.base_model()
    base_name = base["name"] if base else None
    if base is not None and model_id == base_name:
        return JSON(_model_card(base_name, None, base_name, sha256=base.get("sha256")))
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
    pool = pool_of(request)
    parsed = parse_completion(
        await read_body(request, pool.config.body_limit), pool.config.max_prompts
    )
    return await _generate(request, parsed, "completion", caller)


@router.post(
    "/chat/completions",
    summary="Chat completions (OpenAI's API)",
    openapi_extra=openapi_body(ChatRequest),
)
async def chat_completions(request: Request, caller: Submitter):
    pool = pool_of(request)
    body = await read_body(request, pool.config.body_limit)
    parsed = parse_chat(body, await pool.tool_parser(), pool.config.max_prompt_bytes)
    return await _generate(request, parsed, "chat", caller)


async def _generate(request: Request, parsed: Parsed, kind: str, caller: Principal):
    pool = pool_of(request)
    handles, shape, hold = await submit_jobs(request, parsed, kind, caller)
    headers = warned(parsed, request)
    if hold is None:
        setattr(request.state, RIDES_OUTAGES, True)  # Pool.results rides out a Redis outage
        outputs = await pool.results(handles, disconnected(request), caller)
        return JSON(shape.response(outputs), headers=headers)
    events = _stream(shape, handles, parsed.include_usage, *watching(pool, handles, caller))
    return held_stream(hold, events, headers)


def watching(pool: Pool, handles: list, caller: Principal) -> tuple:
    """``chat_events``' ``untaken`` and ``outage`` of ``handles``."""
    return pool.untaken(handles, caller), (pool.watch, pool.config.redis_outage_s)


def held_stream(hold: Hold, events: AsyncIterator[bytes], headers: dict) -> StreamingResponse:
    """The SSE response of ``events``, which gives its hold back when it ends."""
    return hold.stream(events, media_type="text/event-stream", headers={**headers, **NO_BUFFERING})


async def submit_jobs(
    request: Request, parsed: Parsed, kind: str, caller: Principal
) -> tuple[list, Shape, Hold | None]:
    """The jobs of ``parsed`` submitted, the Shape of their reply, and a stream's hold
    (``gateway/holds.py``; None for a call that waits), taken before its rate check and
    job, and given back if they fail."""
    pool = pool_of(request)
    lora = await pool.resolve_model(parsed.model, caller)
    await pool.check_limits(parsed)
    hold = holds_of(request).take(caller.tenant) if parsed.stream else None
    try:
        return (*await _submitted(request, parsed, kind, caller, lora), hold)
    except BaseException:
        if hold is not None:
            hold.release()
        raise


async def _submitted(request, parsed: Parsed, kind: str, caller: Principal, lora):
    pool = pool_of(request)
    await pool.check_rate(caller, len(parsed.prompts), parsed.params, request)
    await pool.heavy.check_grammar(parsed)  # compiled after the rate checks, off the loop
    ids = [caller.job_id(uuid.uuid4().hex) for _ in parsed.prompts]
    metadata = caller.job_metadata(parsed.metadata)
    handles = await pool.submit(
        parsed.prompts, parsed.params, lora, ids, metadata, parsed.names, None, parsed.priority
    )
    params = parsed.params
    public = caller.external_id(handles[0].request_id)
    shape = Shape(kind, public, parsed.model, params.n, params.logprobs or 0,
                  caller.external_id, parsed.names, tools=parsed.tools,
                  system_fingerprint=fingerprint(await pool.base_model()),
                  echo=await _echo(pool, parsed))  # fmt: skip
    return handles, shape


def warned(parsed: Parsed, request: Request) -> dict[str, str]:
    """The reply's header naming the parameters accepted and ignored, and their log line."""
    headers = ignored_header(parsed.ignored)
    if headers:
        logger.warning("%s: ignored parameters %s", request.url.path, headers[IGNORED_HEADER])
    return headers


async def _echo(pool: Pool, parsed: Parsed) -> Echo | None:
    """Completions' echo; a prompt of token ids is decoded with the pool's tokenizer."""
    if not parsed.echo:
        return None
    decode = None
    if any(isinstance(p, dict) for p in parsed.prompts):
        tokenizer = await pool.tokenizers.get(pool.producer.redis, pool.producer.keys.tokenizer)
        decode = None if tokenizer is None else tokenizer.decode
    return Echo(decode, parsed.params.logprobs or 0)


NO_BUFFERING = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _stream(
    shape: Shape, handles: list, include_usage: bool, untaken, outage=(None, 0.0)
) -> AsyncIterator[bytes]:
    """``chat_events`` as SSE, ending with ``[DONE]``."""
    async with aclosing(chat_events(shape, handles, include_usage, untaken, outage)) as events:
        async for event in events:
            yield sse(event)
    yield DONE


async def chat_events(
    shape: Shape, handles: list, include_usage: bool, untaken, outage=(None, 0.0)
) -> AsyncIterator[dict]:
    """The jobs' chunks as OpenAI stream chunks; an error ends them with an error
    object. ``untaken`` (``Pool.untaken``) ends them so while no worker has taken the
    jobs, which are then kept queued."""
    prompt_tokens = completion_tokens = cached = 0
    if shape.chat:
        for event in shape.role_chunks(range(len(handles) * shape.n), include_usage):
            yield event
    kept: set[str] = set()
    watch = asyncio.ensure_future(_keeping(untaken, kept, handles))
    try:
        chunks = until_taken(merged_chunks(handles, kept), watch)
        async for job, chunk in until_outage(chunks, *outage):
            shape.failed(chunk)
            prompt_tokens += len(chunk.prompt_token_ids or ())
            completion_tokens += chunk.num_tokens
            cached += (chunk.metrics and chunk.metrics.num_cached_tokens) or 0
            for event in shape.delta_chunks(job, chunk, include_usage):
                yield event
    except APIError as exc:  # typed as the same failure would be without streaming
        yield exc.body()
    except JobLost as exc:  # its state left Redis: it will never finish
        yield job_lost(shape.public(exc.request_id)).body()
    else:
        if include_usage:
            yield shape.usage_chunk(prompt_tokens, completion_tokens, cached)


async def _keeping(untaken, kept: set[str], handles: list) -> None:
    """``untaken``; when it raises (no worker came), the jobs go into ``kept`` first,
    so that closing their streams leaves them queued."""
    try:
        await untaken
    except APIError:
        kept.update(h.request_id for h in handles)
        raise
