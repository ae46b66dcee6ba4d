"""Background responses (``background: true``, which needs ``store``): ``POST
/v1/responses`` answers at once with the response ``queued``; the gateway that made it
watches its job and stores it ``in_progress`` once the job's first chunk comes, then
``completed``/``incomplete``/``failed``; ``GET /v1/responses/{id}`` (any replica) polls
it; ``POST /v1/responses/{id}/cancel`` aborts the job and stores it ``cancelled``.

Every status change goes through ``ResponseStore.settle``: only a response still queued
or in progress is rewritten, so the first ending wins (a cancel against a job that has
just completed: the cancel's, or the completion's, whichever came first; never both).
A background job waits in the queue as long as it must (no ``no_worker`` 503: a pool
scaled to zero starts a worker for it), up to the stored response's life.

The watch is only the prompt way: the record keeps the request, so any replica that
reads a pending response whose job has ended (``settle_on_read``) settles it from the
job's final record the same way. A gateway that stops, or is killed, while it watches
leaves its background responses to be settled by the next read.

Watches are bounded like held streams (``--max-streams-per-tenant``, ``--max-streams``):
a response made past either bound is not watched here (one debug line) and settles at
its first read instead, so one tenant's flood of background responses costs the gateway
no task, subscription or memory beyond the bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, FastAPI, Request

from lorapool.gateway.auth import Principal, needs
from lorapool.gateway.json import JSON
from lorapool.gateway.openai_api import pool_of, serving_of
from lorapool.gateway.responses_store import RESPONSE_TTL_S, ResponseStore
from lorapool.lifecycle.chunk_log import OutputAssembler
from lorapool.lifecycle.marker import JobLost
from lorapool.lifecycle.response_settle import PENDING
from lorapool.openai.errors import APIError, bad_request
from lorapool.openai.format import Shape, fingerprint
from lorapool.openai.response_bodies import ResponsesRequest
from lorapool.openai.responses import ResponseShape, replied, to_parsed
from lorapool.protocol import RequestOutputKind
from lorapool.tasks import cancel_and_wait

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])
Submitter = Annotated[Principal, needs("submit")]


class Watch:
    """One background response: its shapes, its stored record, and its endings."""

    def __init__(self, store: ResponseStore, shape: ResponseShape, chat: Shape, record: dict):
        self.store, self.shape, self.chat = store, shape, chat
        self.record = record  # the stored record, as it was made (queued)

    async def run(self, handle) -> None:
        """Follows the job to its end (the gateway's task)."""
        try:
            output = await self._final(handle)
        except JobLost as exc:
            await self.fail("job_lost", str(exc))
        except (asyncio.TimeoutError, TimeoutError):
            await handle.abort()
            await self.fail("server_error", f"no result in {RESPONSE_TTL_S}s")
        else:
            await self.end(output)

    async def _final(self, handle):
        """The job's final output; the response in progress from its first chunk on."""
        assembler = OutputAssembler(RequestOutputKind.FINAL_ONLY)
        started = False
        async for chunk in handle.chunks(timeout=RESPONSE_TTL_S):
            if not started:
                started = True
                await self.start()
            if (output := assembler.feed(chunk)) is not None:
                return output
        raise JobLost(handle.request_id)

    async def start(self) -> bool:
        return await self._settle({**self.record["response"], "status": "in_progress"})

    async def end(self, output) -> bool:
        """The response of the job's final output: cancelled when it was aborted,
        failed when the job failed (the error as a streamed response's)."""
        if output.outputs and all(c.finish_reason == "abort" for c in output.outputs):
            return await self._settle({**self.record["response"], "status": "cancelled"})
        try:
            response = self.shape.of_chat(self.chat.response([output]))
        except APIError as exc:
            code = exc.code or ("invalid_prompt" if exc.status == 400 else "server_error")
            return await self.fail(code, exc.message)
        return await self._settle(response, replied(self.record["conversation"], response))

    async def fail(self, code: str, message: str) -> bool:
        error = {"code": code, "message": message}
        return await self._settle(self.shape.envelope("failed", [], error=error))

    async def _settle(self, response: dict, conversation: list | None = None) -> bool:
        if conversation is None:
            conversation = self.record["conversation"]
        return await self.store.settle({**self.record, "response": response,
                                        "conversation": conversation})  # fmt: skip


class BackgroundResponses:
    """A gateway's watches (``app.state.background_responses``), at most ``per_tenant``
    of one tenant's and ``total`` in all (None or 0: unbounded), cancelled when it stops
    (their responses are then settled by whichever replica reads them)."""

    def __init__(self, per_tenant: int | None = None, total: int | None = None):
        self.per_tenant, self.total = per_tenant or None, total or None  # 0: no cap, as holds
        self.tasks: dict[asyncio.Task, str | None] = {}  # each watch's tenant
        self.by_tenant: Counter = Counter()

    def start(self, watch: Watch, handle, tenant: str | None) -> bool:
        """Watch ``handle``'s job for ``watch``'s response; False (left to its first
        read) past a bound."""
        over = self.total is not None and len(self.tasks) >= self.total
        if self.per_tenant is not None and self.by_tenant[tenant] >= self.per_tenant:
            over = True
        if over:
            logger.debug("background response of %s left to its first read: watches full", tenant)
            return False
        task = asyncio.create_task(watch.run(handle))
        self.tasks[task] = tenant
        self.by_tenant[tenant] += 1
        task.add_done_callback(self._ended)
        return True

    def _ended(self, task: asyncio.Task) -> None:
        tenant = self.tasks.pop(task, None)
        self.by_tenant[tenant] -= 1
        if self.by_tenant[tenant] <= 0:
            del self.by_tenant[tenant]
        if not task.cancelled() and task.exception() is not None:
            logger.error("background response watch failed", exc_info=task.exception())

    async def close(self) -> None:
        await cancel_and_wait(*self.tasks)


def background_of(app: FastAPI) -> BackgroundResponses:
    if not hasattr(app.state, "background_responses"):
        config = app.state.pool.config  # the held streams' bounds (``holds.py``)
        app.state.background_responses = BackgroundResponses(
            config.max_streams_per_tenant, config.max_streams
        )
    return app.state.background_responses


async def start_background(
    request: Request, store: ResponseStore, shape: ResponseShape, chat: Shape, handles: list,
    conversation: list[dict[str, Any]], num_previous: int, headers: dict[str, str],
) -> JSON:  # fmt: skip
    """The response stored ``queued`` and returned; its job watched from here. The
    record keeps the request and how many messages of ``conversation`` came before it
    (``previous_response_id``'s), so that another replica can shape the reply."""
    response = shape.envelope("queued", [])
    jobs, asked = [handle.request_id for handle in handles], msgspec.to_builtins(shape.request)
    background = {"jobs": jobs, "request": asked, "previous": num_previous}
    await store.save(response, conversation, background=background)
    record = {"response": response, "conversation": conversation, "input_items": store.items,
              "background": background}  # fmt: skip
    background_of(request.app).start(
        Watch(store, shape, chat, record), handles[0], store.caller.tenant
    )
    return JSON(response, headers=headers)


async def _rebuilt(request: Request, caller: Principal, store: ResponseStore, record) -> Watch:
    """The Watch of a stored background response, its shapes made again from its request
    (as the gateway that created it made them)."""
    pool, saved = pool_of(request), record["background"]
    body = msgspec.convert(saved["request"], ResponsesRequest)
    previous = record["conversation"][: saved["previous"]]
    parser = await serving_of(request).tool_parser()
    parsed, _ = to_parsed(body, previous, parser, pool.config.max_prompt_bytes)
    public = record["response"]["id"].removeprefix("resp_")
    params = parsed.params
    chat = Shape("chat", public, parsed.model, params.n, params.logprobs or 0,
                 caller.external_id, parsed.names, tools=parsed.tools,
                 system_fingerprint=fingerprint(await pool.base_model()))  # fmt: skip
    shape = ResponseShape(body, public, True)
    shape.created_at = record["response"]["created_at"]
    return Watch(store, shape, chat, record)


async def settle_on_read(
    request: Request, caller: Principal, store: ResponseStore, record: dict
) -> dict:
    """``record``, or, for a background response still pending whose job has begun or
    ended, the record as that makes it (settled here: its watch may be gone)."""
    if "background" not in record or record["response"]["status"] not in PENDING:
        return record
    pool = pool_of(request)
    job = record["background"]["jobs"][0]
    state = await pool.view.job_state(job)
    pending = state is not None and not state["final"]
    if pending and (not state["started"] or record["response"]["status"] == "in_progress"):
        return record  # nothing new: queued, or running and already said so
    watch = await _rebuilt(request, caller, store, record)
    if state is None:
        await watch.fail("job_lost", f"the response's job {job!r} left Redis")
    elif not state["final"]:
        await watch.start()
    else:
        await watch.end(await (await pool.handle(job)).result(timeout=5.0))
    return await store.load(record["response"]["id"])


def ended(record: dict, param: str) -> dict:
    """``record``, whose response must have ended to be continued (400 naming ``param``)."""
    status = record["response"]["status"]
    if status in PENDING:
        raise bad_request(f"response {record['response']['id']} is still {status}", param)
    return record


@router.post("/responses/{response_id}/cancel", summary="Cancel a background response")
async def cancel_response(response_id: str, request: Request, caller: Submitter) -> JSON:
    """The response ``cancelled`` and its job aborted, if it was queued or in progress;
    otherwise the response as it ended (a second cancel gives the same). 400 for a
    response made without ``background``."""
    pool = pool_of(request)
    store = ResponseStore(pool.producer.redis, pool.producer.keys, caller)
    record = await store.load(response_id)
    if "background" not in record:
        raise APIError(400, "Only responses created with background: true can be cancelled.")
    if record["response"]["status"] in PENDING:
        for job in record["background"]["jobs"]:
            await pool.producer.abort(job)
        cancelled = {**record, "response": {**record["response"], "status": "cancelled"}}
        if await store.settle(cancelled):
            return JSON(cancelled["response"])
        record = await store.load(response_id)
    return JSON(record["response"])
