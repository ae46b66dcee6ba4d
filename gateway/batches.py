"""OpenAI's Files and Batches API over lorapool's batches (``lorapool.batch``), so the
official client's ``files.create``, ``files.list``, ``files.delete``, ``batches.create``,
``batches.list``, ``batches.retrieve``, ``batches.cancel`` and ``files.content`` work
unchanged:

- ``POST /v1/files`` (multipart: ``file``, ``purpose=batch``) -> the file object;
- ``GET /v1/files`` (``purpose``, ``limit``, ``order``, ``after``), ``DELETE /v1/files/{id}``;
- ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content`` (streamed a line at a time);
- ``POST /v1/batches`` -> the batch (``validating``; RQ workers run it);
- ``GET /v1/batches`` (``limit``, ``after``), ``GET /v1/batches/{id}``,
  ``POST /v1/batches/{id}/cancel``; a batch carries its lines' token ``usage``.

Files live in the pool's Redis (``lorapool.batch.files``), so every gateway replica and
the RQ workers of ``$LORAPOOL_BATCH_QUEUE`` (default ``lorapool-batch``) see them. With auth on, a
key limited to some adapters may not run batches yet (lines are not checked per key).
"""

from __future__ import annotations

import asyncio
import os
from typing import Annotated, Any

from fastapi import APIRouter, Request
from msgspec import Struct

from lorapool.gateway.auth import Principal, needs
from lorapool.gateway.body import read_struct
from lorapool.gateway.holds import holds_of
from lorapool.gateway.json import JSON
from lorapool.gateway.turns import end_turn
from lorapool.openai.errors import APIError

router = APIRouter(prefix="/v1", tags=["batches"])
Submitter = Annotated[Principal, needs("submit")]


class CreateBatch(Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's ``batches.create`` body; which endpoints and windows exist, and that the
    file is the caller's, the service checks (``BatchService.create``, the CLI's too)."""

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def _service(request: Request):
    """The app's BatchService, made on first use (a synchronous client: its calls run
    in threads)."""
    state = request.app.state
    if getattr(state, "batches", None) is None:
        from lorapool.batch import BatchConfig, BatchService
        from lorapool.connection import connect

        config = request.app.state.pool.config
        queue = os.environ.get("LORAPOOL_BATCH_QUEUE", "lorapool-batch")
        batch_config = BatchConfig(
            prefix=config.prefix, shards=config.shards, queue=queue, max_stop=config.max_stop
        )
        connection = connect(config.redis_url, config.redis_retries, **config.redis_options())
        state.batches = BatchService(connection, batch_config)
    return state.batches


async def _call(request: Request, method: str, *args: Any) -> Any:
    from lorapool.batch import BatchError

    try:
        return await asyncio.to_thread(getattr(_service(request), method), *args)
    except BatchError as exc:
        raise APIError(exc.status, str(exc), exc.param) from None


def _unrestricted(caller: Principal) -> None:
    if caller.adapters is not None:
        raise APIError(403, "batches need a key that may use every adapter", code="forbidden")


UPLOAD_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string"},
                    },
                }
            }
        },
    }
}


@router.post(
    "/files", summary="Upload a batch input file (OpenAI's Files API)", openapi_extra=UPLOAD_FORM
)
async def create_file(request: Request, caller: Submitter) -> JSON:
    """The form is read here, after the key, its rate (``auth.require``) and a hold
    (``gateway/holds.py``): an upload is a long-lived request, and no body is read for
    a caller refused."""
    _unrestricted(caller)
    with holds_of(request).holding(caller.tenant):
        end_turn(request)  # a slow upload, bounded by its hold, keeps the key's turn free
        async with request.form(max_files=1, max_fields=8) as form:
            file, purpose = form.get("file"), form.get("purpose")
            if not hasattr(file, "file"):
                raise APIError(400, "file is required: the batch input as a file part", "file")
            if not isinstance(purpose, str):
                raise APIError(400, "purpose is required: 'batch'", "purpose")
            name = file.filename or "input.jsonl"
            return JSON(await _call(request, "upload", file.file, name, purpose, caller.tenant))


@router.get("/files", summary="The caller's files (OpenAI's pagination)")
async def list_files(
    request: Request,
    caller: Submitter,
    purpose: str | None = None,
    limit: int | None = None,
    order: str = "desc",
    after: str | None = None,
) -> JSON:
    return JSON(await _call(request, "list_files", caller.tenant, purpose, limit, order, after))


@router.delete("/files/{file_id}", summary="Delete a file")
async def delete_file(request: Request, file_id: str, caller: Submitter) -> JSON:
    return JSON(await _call(request, "delete_file", file_id, caller.tenant))


@router.get("/files/{file_id}", summary="A file's object")
async def retrieve_file(request: Request, file_id: str, caller: Submitter) -> JSON:
    return JSON(await _call(request, "file", file_id, caller.tenant))


@router.get("/files/{file_id}/content", summary="A file's content")
async def file_content(request: Request, file_id: str, caller: Submitter):
    hold = holds_of(request).take(caller.tenant)  # a slow reader holds a thread
    try:
        lines = await _call(request, "content", file_id, caller.tenant)
    except BaseException:
        hold.release()
        raise
    return hold.stream(_iterate(lines), media_type="application/jsonl")


async def _iterate(lines):
    done = object()
    while (line := await asyncio.to_thread(next, lines, done)) is not done:
        yield line


@router.post("/batches", summary="Create a batch over an uploaded file (OpenAI's Batch API)")
async def create_batch(request: Request, caller: Submitter) -> JSON:
    _unrestricted(caller)
    body = await read_struct(request, 1 << 20, CreateBatch)
    args = (body.input_file_id, body.endpoint, body.completion_window, body.metadata)
    # its tenant and key id: into every line's job; its lines are paced by the key's limits
    args += (caller.metadata() or None,)
    return JSON(await _call(request, "create", *args))


@router.get("/batches", summary="The caller's batches, newest first (OpenAI's pagination)")
async def list_batches(
    request: Request, caller: Submitter, limit: int | None = None, after: str | None = None
) -> JSON:
    return JSON(await _call(request, "list_batches", caller.tenant, limit, after))


@router.get("/batches/{batch_id}", summary="A batch's state")
async def retrieve_batch(request: Request, batch_id: str, caller: Submitter) -> JSON:
    return JSON(await _call(request, "retrieve", batch_id, caller.tenant))


@router.post("/batches/{batch_id}/cancel", summary="Cancel a batch")
async def cancel_batch(request: Request, batch_id: str, caller: Submitter) -> JSON:
    return JSON(await _call(request, "cancel", batch_id, caller.tenant))
