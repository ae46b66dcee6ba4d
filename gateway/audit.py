"""The audit trail over HTTP for compliance tools (role ``audit``; a tenant's auditor
reads its own tenant, an ``--all-tenants`` key every one), the CLI's queries as JSON,
or CSV with ``Accept: text/csv``:

- ``GET /v1/audit/completions/{request_id}``: the rows of one request;
- ``GET /v1/audit/completions?adapter=&sha256=&tenant=&since=&until=&finish_reason=&q=``
  (``limit``, ``cursor``: the ``next_cursor`` of the page before);
- ``GET /v1/audit/usage?group_by=adapter|adapter_version|tenant&since=&until=``;
- ``GET /v1/audit/verify``: the keyed hash chain walked (all tenants' auditors only).

Served when the gateway has ``--audit-db-url``; otherwise 404.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse, Response

from lorapool.gateway.audit_store import MAX_LIMIT, AuditStore, parse_time, to_csv
from lorapool.gateway.auth import Principal, require
from lorapool.gateway.errors import APIError
from lorapool.gateway.json import JSON

router = APIRouter(prefix="/v1/audit", tags=["audit"])
Auditor = Annotated[Principal, Depends(require("audit"))]


def _store(request: Request) -> AuditStore:
    store = request.app.state.audit
    if store is None:
        raise APIError(404, "the audit trail is not served here (--audit-db-url)")
    return store


def _answer(request: Request, rows: list[dict], extra: dict | None = None) -> Response:
    if "text/csv" in request.headers.get("accept", ""):
        return PlainTextResponse(to_csv(rows), media_type="text/csv")
    return JSON({"object": "list", "data": rows, **(extra or {})})


@router.get("/completions/{request_id}", summary="The audit rows of one request")
async def audit_request(request: Request, request_id: str, caller: Auditor) -> Response:
    rows = await _store(request).request(caller, request_id)
    if not rows:
        raise APIError(404, "no audit rows for this request", "request_id", code="not_found")
    return _answer(request, rows)


@router.get("/completions", summary="Audit rows matching filters, a page at a time")
async def audit_search(
    request: Request,
    caller: Auditor,
    adapter: str | None = None,
    sha256: str | None = Query(None, pattern="^[0-9a-fA-F]{1,64}$"),
    tenant: str | None = None,
    since: str | None = None,
    until: str | None = None,
    finish_reason: str | None = None,
    q: str | None = None,
    limit: int = Query(100, ge=1, le=MAX_LIMIT),
    cursor: str | None = None,
) -> Response:
    filters = {
        "adapter_name": adapter,
        "adapter_sha256": sha256,
        "tenant": tenant,
        "since": parse_time(since, "since"),
        "until": parse_time(until, "until"),
        "finish_reason": finish_reason,
        "text": q,
    }
    rows, next_cursor = await _store(request).search(caller, filters, limit, cursor)
    return _answer(request, rows, {"next_cursor": next_cursor})


@router.get("/usage", summary="Token counts and latency percentiles per group")
async def audit_usage(
    request: Request,
    caller: Auditor,
    group_by: str = "adapter",
    since: str | None = None,
    until: str | None = None,
) -> Response:
    store = _store(request)
    rows = await store.usage(
        caller, group_by, parse_time(since, "since"), parse_time(until, "until")
    )
    return _answer(request, rows)


@router.get("/verify", summary="Walk the keyed hash chain of the audit table")
async def audit_verify(request: Request, caller: Auditor) -> JSON:
    from lorapool import signing

    if caller.tenant is not None and not caller.all_tenants:
        raise APIError(403, "verifying the whole chain needs an --all-tenants audit key")
    key = signing.key_from_env()
    if key is None:
        raise APIError(503, "the gateway has no audit key (LORAPOOL_AUDIT_KEY) to verify with")
    report = await _store(request).verify(key)
    return JSON(report, status_code=200 if report["ok"] else 409)
