"""Asynchronous jobs, for web apps that must not hold a connection open:

- ``POST /v1/jobs`` → 202, the job id and ``Location``; ``Idempotency-Key`` (or the
  body's ``request_id``) makes a retried submit find the job it made;
- ``GET /v1/jobs/{id}`` → queued (with the backlog, and its position: the jobs no
  worker has taken yet ahead of it, 0 = next), running, finished, failed or
  aborted, and the result once final, with the adapter's full identity and the worker;
- ``GET /v1/jobs/{id}/events`` → SSE of the job's chunks, event id = chunk seq, so an
  EventSource reconnecting with ``Last-Event-ID`` resumes without gaps or repeats;
- ``DELETE /v1/jobs/{id}`` → asks the worker holding it to abort it.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Header, Request
from fastapi.responses import StreamingResponse

from lorapool.gateway.auth import Principal, needs
from lorapool.gateway.body import read_body
from lorapool.gateway.holds import holds_of
from lorapool.gateway.job_format import chunk_event, job_body, state_name
from lorapool.gateway.json import JSON
from lorapool.gateway.openai_api import HTTPDoor, serving_of, warned
from lorapool.gateway.pool import Pool
from lorapool.gateway.redis_watch import until_outage
from lorapool.gateway.streams import guarded, sse, until_stopped
from lorapool.lifecycle.marker import RedisAway
from lorapool.openai.admission import redis_unavailable
from lorapool.openai.bodies import ChatJob, CompletionJob, openapi_body
from lorapool.openai.errors import APIError, bad_request, job_lost
from lorapool.openai.params import parse_job
from lorapool.producer import JobLost
from lorapool.records.bounds import is_request_id

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
Submitter = Annotated[Principal, needs("submit")]
Submitting = Annotated[Principal, needs("submit", submits=True)]  # check_rate
NO_BUFFERING = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _pool(request: Request) -> Pool:
    return request.app.state.pool


def idempotent_id(key: str) -> str:
    """The request id an Idempotency-Key stands for: the same key, the same job."""
    return "idem-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:40]


@router.post(
    "",
    status_code=202,
    summary="Submit a job; 202 with its id and Location",
    openapi_extra=openapi_body(CompletionJob, ChatJob),
)
async def submit_job(
    request: Request,
    caller: Submitting,
    idempotency_key: str | None = Header(default=None, max_length=256),
) -> JSON:
    pool = _pool(request)
    parsed, request_id, on_finish = parse_job(await read_body(request, pool.config.body_limit))
    if idempotency_key is not None:
        if request_id is not None:
            raise bad_request("give either request_id or Idempotency-Key", "request_id")
        request_id = idempotent_id(idempotency_key)
    _check_request_id(request_id)
    serving = serving_of(request)
    lora = await serving.prepare(parsed, caller)
    if on_finish is not None:
        await serving.check_webhook(on_finish, caller)
    HTTPDoor(request, caller).rated(await serving.check_rate(caller, 1, parsed.params))
    await serving.check_grammar(parsed)  # compiled after the rate checks, off the loop
    job_id = caller.job_id(request_id or uuid.uuid4().hex)
    [handle] = await serving.enqueue(parsed, lora, caller, [job_id], on_finish)
    external = caller.external_id(handle.request_id)
    body = {"id": external, "object": "job", "model": parsed.model}
    body["status"] = "queued" if handle.enqueued else await _status(pool, handle.request_id)
    # a URI reference: the id percent-encoded (a header holds latin-1 only; a request
    # id "Ā" answered 500), which the GET route decodes back
    location = f"/v1/jobs/{quote(external, safe='')}"
    headers = {"Location": location, **warned(parsed, request)}
    return JSON(body, status_code=202, headers=headers)


def _check_request_id(request_id) -> None:
    """A client's job id must stay reachable at its own Location: no ``/`` (a path
    separator: ``a/b`` would be routed elsewhere), not ``.`` or ``..`` (which clients
    fold away); the job boundary checks the rest (a string, its length, no braces or
    NUL)."""
    if isinstance(request_id, str) and ("/" in request_id or request_id in (".", "..")):
        raise bad_request(
            f"request_id may not contain '/' or be '.' or '..', got {request_id[:80]!r}",
            "request_id",
        )


async def _state(pool: Pool, job_id: str) -> dict:
    state = await pool.view.job_state(job_id) if is_request_id(job_id) else None
    if state is None:
        raise APIError(404, "no such job", "id", code="job_not_found")
    return state


async def _status(pool: Pool, job_id: str) -> str:
    state = await _state(pool, job_id)
    if not state["final"]:
        return state_name(state, None)
    return state_name(state, await (await pool.handle(job_id)).result())


@router.get("/{job_id}", summary="A job's status, and its result once final")
async def get_job(request: Request, job_id: str, caller: Submitter) -> JSON:
    pool = _pool(request)
    external, job_id = job_id, caller.job_id(job_id)
    state = await _state(pool, job_id)
    if not state["final"]:
        body = {"id": external, "object": "job", "status": state_name(state, None)}
        if not state["started"]:
            body["backlog"] = await pool.view.backlog()
            position = await pool.position(job_id)
            if position is not None:  # waiting in the stream, not yet taken by a worker
                body["position"] = position
        return JSON(body)
    output = await (await pool.handle(job_id)).result(timeout=pool.config.result_timeout_s)
    adapter = None
    if output.lora_request is not None:
        adapter = await pool.view.adapter(output.lora_request.lora_name)
    base = await pool.view.base_model()
    status, internals = state_name(state, output), caller.sees_internals
    return JSON(job_body(external, status, output, adapter, base, internals))


@router.get("/{job_id}/events", summary="The job's chunks as server-sent events")
async def job_events(
    request: Request,
    job_id: str,
    caller: Submitter,
    last_event_id: str | None = Header(default=None),
) -> StreamingResponse:
    """Event ``chunk`` per chunk, id = its seq; the stream ends after the final one. A
    reconnect with ``Last-Event-ID: n`` gets the chunks after seq n."""
    pool = _pool(request)
    after = -1
    if last_event_id is not None:
        if not last_event_id.isdigit() or len(last_event_id) > 18:
            raise bad_request("Last-Event-ID must be a chunk seq number", "Last-Event-ID")
        after = int(last_event_id)
    state = await _state(pool, caller.job_id(job_id))
    handle = await pool.handle(caller.job_id(job_id))
    stopping, max_s = request.app.state.stopping, pool.config.events_max_s
    public = None if caller.sees_internals else job_id
    outage = (pool.watch, pool.config.redis_outage_s)
    hold = holds_of(request).take(caller.tenant)  # 429/503 past the caps (gateway/holds.py)
    events = until_stopped(_events(handle, after, state, public, outage), stopping, max_s)
    return hold.stream(events, media_type="text/event-stream", headers=NO_BUFFERING)


async def _events(
    handle, after: int, state: dict, public: str | None = None, outage=(None, 0.0)
) -> AsyncIterator[bytes]:
    """A final job is read from its first chunk (a reader placed at the final seq would
    wait for the log's compaction to learn that nothing follows); once its log is
    compacted, the rest of an output cannot be cut at a seq: an ``error`` event says so.
    ``public``: the job's id as its tenant knows it (then nothing internal is sent).
    Redis away longer than ``outage``'s seconds ends it with an ``error`` event too: a
    reconnect with Last-Event-ID once it is back gets the rest."""
    name = public or handle.request_id
    yield b"retry: 1000\n\n"
    start = -1 if state["final"] else after
    try:
        async for chunk in until_outage(guarded(handle, start, abort=False), *outage):
            if chunk.seq <= after:
                continue
            if after >= 0 and start < after and not state["log"]:
                raise LookupError(f"the chunk log of {name} was compacted")
            yield sse(chunk_event(chunk, public), "chunk", chunk.seq)
    except LookupError as exc:  # compacted before this reader got its place
        message = f"{exc}; GET /v1/jobs/{quote(name, safe='')} has the whole result"
        yield sse({"message": message, "id": name}, "error")
    except RedisAway as exc:  # Redis away too long: resume with Last-Event-ID later
        yield sse({**redis_unavailable(exc).body()["error"], "id": name}, "error")
    except JobLost:  # its state left Redis: nothing will follow
        yield sse({**job_lost(name).body()["error"], "id": name}, "error")


@router.delete("/{job_id}", summary="Abort a job")
async def abort_job(request: Request, job_id: str, caller: Submitter) -> JSON:
    """202 while the worker holding it is asked to stop it (finish_reason ``abort``);
    200 with its status when it is already final."""
    pool = _pool(request)
    external, job_id = job_id, caller.job_id(job_id)
    state = await _state(pool, job_id)
    body = {"id": external, "object": "job"}
    if state["final"]:
        return JSON({**body, "status": await _status(pool, job_id)})
    await (await pool.handle(job_id)).abort()
    return JSON({**body, "status": "aborting"}, status_code=202)
