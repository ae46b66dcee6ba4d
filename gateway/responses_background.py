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

The watch lives in the gateway that created the response: a gateway that stops first
aborts the job and stores the response ``failed`` (``server_error``), so that no
response stays in progress after no one watches it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request

from lorapool.gateway.auth import Principal, require
from lorapool.gateway.json import JSON
from lorapool.gateway.openai_api import pool_of
from lorapool.gateway.responses_store import RESPONSE_TTL_S, ResponseStore
from lorapool.lifecycle.chunk_log import OutputAssembler
from lorapool.lifecycle.marker import JobLost
from lorapool.lifecycle.response_settle import PENDING
from lorapool.openai.errors import APIError
from lorapool.openai.responses import ResponseShape, replied
from lorapool.protocol import RequestOutputKind
from lorapool.tasks import cancel_and_wait

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])
Submitter = Annotated[Principal, Depends(require("submit"))]
STOPPED = "the gateway watching this response stopped before it ended; its job was aborted"


class Watch:
    """One background response's job, watched to its end."""

    def __init__(self, store: ResponseStore, shape: ResponseShape, chat, handle, record: dict):
        self.store, self.shape, self.chat, self.handle = store, shape, chat, handle
        self.record = record  # the stored record, queued

    async def run(self) -> None:
        try:
            response = self._ended(await self._final())
        except APIError as exc:
            response = self._failed(exc.code or _code(exc.status), exc.message)
        except JobLost as exc:
            response = self._failed("server_error", str(exc))
        except (asyncio.TimeoutError, TimeoutError):
            await self.handle.abort()
            response = self._failed("server_error", f"no result in {RESPONSE_TTL_S}s")
        conversation = self.record["conversation"]
        if response["status"] in ("completed", "incomplete"):
            conversation = replied(conversation, response)
        await self._settle(response, conversation)

    async def _final(self):
        """The job's final output; the response in progress from its first chunk on."""
        assembler = OutputAssembler(RequestOutputKind.FINAL_ONLY)
        started = False
        async for chunk in self.handle.chunks(timeout=RESPONSE_TTL_S):
            if not started:
                started = True
                await self._settle({**self.record["response"], "status": "in_progress"})
            if (output := assembler.feed(chunk)) is not None:
                return output
        raise JobLost(self.handle.request_id)

    def _ended(self, output) -> dict[str, Any]:
        if output.outputs and all(c.finish_reason == "abort" for c in output.outputs):
            return {**self.record["response"], "status": "cancelled"}
        return self.shape.of_chat(self.chat.response([output]))  # APIError: a failed job

    def _failed(self, code: str, message: str) -> dict[str, Any]:
        error = {"code": code, "message": message}
        return self.shape.envelope("failed", [], error=error)

    async def _settle(self, response: dict, conversation: list | None = None) -> bool:
        if conversation is None:
            conversation = self.record["conversation"]
        return await self.store.settle({**self.record, "response": response,
                                        "conversation": conversation})  # fmt: skip

    async def stopped(self) -> None:
        """The gateway stops before the job ended: the job aborted, the response failed."""
        await self.handle.abort()
        await self._settle(self._failed("server_error", STOPPED))


def _code(status: int) -> str:
    return "invalid_prompt" if status == 400 else "server_error"


class BackgroundResponses:
    """A gateway's watches (``app.state.background_responses``), ended with it."""

    def __init__(self):
        self.watches: dict[asyncio.Task, Watch] = {}

    def start(self, watch: Watch) -> None:
        task = asyncio.create_task(watch.run())
        self.watches[task] = watch
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        self.watches.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background response watch failed", exc_info=task.exception())

    async def close(self) -> None:
        """Each watch still running cancelled, its job aborted and its response failed."""
        watches = dict(self.watches)
        await cancel_and_wait(*watches)
        for watch in watches.values():
            try:
                await watch.stopped()
            except Exception:  # Redis away at shutdown: the response expires with its TTL
                logger.warning("background response %s: not marked failed", watch.shape.id)


def background_of(app: FastAPI) -> BackgroundResponses:
    if not hasattr(app.state, "background_responses"):
        app.state.background_responses = BackgroundResponses()
    return app.state.background_responses


async def start_background(
    request: Request, store: ResponseStore, shape: ResponseShape, chat, handles: list,
    conversation: list[dict[str, Any]], headers: dict[str, str],
) -> JSON:  # fmt: skip
    """The response stored ``queued`` and returned; its job watched from here."""
    response = shape.envelope("queued", [])
    jobs = {"jobs": [handle.request_id for handle in handles]}
    await store.save(response, conversation, background=jobs)
    record = {"response": response, "conversation": conversation, "input_items": store.items,
              "background": jobs}  # fmt: skip
    background_of(request.app).start(Watch(store, shape, chat, handles[0], record))
    return JSON(response, headers=headers)


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
