"""The audit trail over HTTP for compliance tools (role ``audit``; a tenant's auditor
reads its own tenant, an ``--all-tenants`` key every one), the CLI's queries as JSON,
or CSV with ``Accept: text/csv``:

- ``GET /v1/audit/completions/{request_id}``: the rows of one request;
- ``GET /v1/audit/completions?adapter=&sha256=&tenant=&since=&until=&finish_reason=&q=``
  a page at a time (``limit``, ``cursor``): the next page's cursor is ``next_cursor``
  in JSON, and in the ``X-Next-Cursor`` and ``Link: <...>; rel="next"`` headers of
  both JSON and CSV pages;
- ``GET /v1/audit/export?format=csv|jsonl|json&`` (the same filters): every matching
  row, streamed from a server-side cursor (memory stays bounded at any size);
- ``GET /v1/audit/usage?group_by=adapter|adapter_version|tenant&since=&until=&exact=``
  (``latency_exact`` says whether the percentiles came from the rows or the rollup);
- ``POST /v1/audit/verify?mode=incremental|full``: starts a verification job (202,
  ``Location``) or answers with the one of that mode already running (200);
  ``GET /v1/audit/verify/{id}``: its status and progress; ``GET /v1/audit/verify``
  (``mode``, ``wait`` seconds, at most 30): starts or joins a job and waits that long
  for it (200 verified, 409 failed, 202 still running). All tenants' auditors only.

Served when the gateway has ``--audit-db-url``; otherwise 404.
"""

from __future__ import annotations

import asyncio
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from lorapool.audit_export import FORMATS, MEDIA_TYPES, encode
from lorapool.gateway.audit_store import MAX_LIMIT, AuditStore, parse_time, to_csv
from lorapool.gateway.auth import Principal, needs
from lorapool.gateway.holds import holds_of
from lorapool.gateway.json import JSON
from lorapool.gateway.turns import end_turn
from lorapool.lifecycle.audit_verification import MODES
from lorapool.openai.errors import APIError

router = APIRouter(prefix="/v1/audit", tags=["audit"])
Auditor = Annotated[Principal, needs("audit")]
MAX_WAIT_S = 30.0


def _store(request: Request) -> AuditStore:
    store = request.app.state.audit
    if store is None:
        raise APIError(404, "the audit trail is not served here (--audit-db-url)")
    return store


def _wants_csv(request: Request) -> bool:
    return "text/csv" in request.headers.get("accept", "")


def _answer(request: Request, rows: list[dict], extra: dict | None = None, headers=None):
    if _wants_csv(request):
        return PlainTextResponse(to_csv(rows), media_type="text/csv", headers=headers)
    return JSON({"object": "list", "data": rows, **(extra or {})}, headers=headers)


@router.get("/completions/{request_id}", summary="The audit rows of one request")
async def audit_request(request: Request, request_id: str, caller: Auditor) -> Response:
    rows = await _store(request).request(caller, request_id)
    if not rows:
        raise APIError(404, "no audit rows for this request", "request_id", code="not_found")
    return _answer(request, rows)


def _filters(
    adapter: str | None = None,
    sha256: str | None = Query(None, pattern="^[0-9a-fA-F]{1,64}$"),
    tenant: str | None = None,
    since: str | None = None,
    until: str | None = None,
    finish_reason: str | None = None,
    q: str | None = None,
) -> dict:
    return {
        "adapter_name": adapter,
        "adapter_sha256": sha256,
        "tenant": tenant,
        "since": parse_time(since, "since"),
        "until": parse_time(until, "until"),
        "finish_reason": finish_reason,
        "text": q,
    }


Filters = Annotated[dict, Depends(_filters)]


def _next_headers(request: Request, cursor: str | None) -> dict[str, str]:
    if cursor is None:
        return {}
    params = [(k, v) for k, v in request.query_params.multi_items() if k != "cursor"]
    link = f"{request.url.path}?{urlencode([*params, ('cursor', cursor)])}"
    return {"X-Next-Cursor": cursor, "Link": f'<{link}>; rel="next"'}


@router.get("/completions", summary="Audit rows matching filters, a page at a time")
async def audit_search(
    request: Request,
    caller: Auditor,
    filters: Filters,
    limit: int = Query(100, ge=1, le=MAX_LIMIT),
    cursor: str | None = None,
) -> Response:
    rows, next_cursor = await _store(request).page(caller, filters, limit, cursor)
    headers = _next_headers(request, next_cursor)
    return _answer(request, rows, {"next_cursor": next_cursor}, headers)


@router.get("/export", summary="Every matching audit row, streamed")
async def audit_export(
    request: Request,
    caller: Auditor,
    filters: Filters,
    format: str = Query("jsonl", description="csv, jsonl or json"),
) -> StreamingResponse:
    if format not in FORMATS:
        raise APIError(400, f"format must be one of {', '.join(FORMATS)}", "format")
    rows = await _store(request).export(caller, filters)
    disposition = f'attachment; filename="audit-export.{format}"'
    hold = holds_of(request).take(caller.tenant)  # a slow reader holds a cursor and a thread
    return hold.stream(
        encode(rows, format),
        media_type=MEDIA_TYPES[format],
        headers={"Content-Disposition": disposition},
    )


@router.get("/usage", summary="Token counts and latency percentiles per group")
async def audit_usage(
    request: Request,
    caller: Auditor,
    group_by: str = "adapter",
    since: str | None = None,
    until: str | None = None,
    exact: bool | None = Query(None, description="rows (true) or the daily rollup (false)"),
) -> Response:
    store = _store(request)
    period = parse_time(since, "since"), parse_time(until, "until")
    rows = await store.usage(caller, group_by, *period, exact)
    return _answer(request, rows)


def _jobs(request: Request, caller: Principal):
    from lorapool import signing

    store = _store(request)
    if caller.tenant is not None and not caller.all_tenants:
        raise APIError(403, "verifying the whole chain needs an --all-tenants audit key")
    key = signing.key_from_env()
    if key is None:
        raise APIError(503, "the gateway has no audit key (LORAPOOL_AUDIT_KEY) to verify with")
    return store.verify_jobs(request.app.state.pool), key


def _mode(mode: str) -> str:
    if mode not in MODES:
        raise APIError(400, f"mode must be one of {', '.join(MODES)}", "mode")
    return mode


def _job_answer(job, created: bool) -> JSON:
    body = job.public()
    if job.done:
        status = 200 if job.ok else 409
    else:
        status = 202 if created or body["status"] == "running" else 200
    headers = {"Location": f"/v1/audit/verify/{job.id}"}
    return JSON({**body, "ok": job.ok}, status_code=status, headers=headers)


@router.post("/verify", summary="Start verifying the keyed hash chain (a job)")
async def start_verify(request: Request, caller: Auditor, mode: str = "incremental") -> JSON:
    jobs, key = _jobs(request, caller)
    job, created = await asyncio.to_thread(jobs.start, _mode(mode), key)
    return _job_answer(job, created)


@router.get("/verify/{job_id}", summary="A verification job's status and progress")
async def verify_status(request: Request, caller: Auditor, job_id: str) -> JSON:
    jobs, _key = _jobs(request, caller)
    job = await asyncio.to_thread(jobs.get, job_id)
    if job is None:
        raise APIError(404, "no such verification job", "job_id", code="not_found")
    return _job_answer(job, False)


@router.get("/verify", summary="Start or join a verification job and wait a while for it")
async def audit_verify(
    request: Request,
    caller: Auditor,
    mode: str = "incremental",
    wait: float = Query(0.0, ge=0, le=MAX_WAIT_S),
) -> JSON:
    jobs, key = _jobs(request, caller)
    job, created = await asyncio.to_thread(jobs.start, _mode(mode), key)
    end_turn(request)  # waiting up to 30 s for the job holds no turn of the key's
    deadline = asyncio.get_running_loop().time() + wait
    while not job.done and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
        job = await asyncio.to_thread(jobs.get, job.id) or job
    return _job_answer(job, created)
