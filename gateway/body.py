"""Request bodies: read up to the configured size (413 past it), parsed as JSON (400)."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from fastapi import Request

from lorapool.openai.bodies import parse
from lorapool.openai.errors import APIError

T = TypeVar("T")


async def read_json(request: Request, limit: int) -> Any:
    """The body's JSON value; 413 when it is over ``limit`` bytes, whatever its
    Content-Length says; 400 when it is not JSON."""
    body = await read_body(request, limit)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


async def read_struct(request: Request, limit: int, kind: type[T]) -> T:
    """The body (``read_json``'s limit) as the msgspec Struct ``kind``: a 400 naming the
    parameter at fault, worded as the OpenAI routes' (``lorapool.openai.bodies.parse``)."""
    body = await read_body(request, limit)
    try:
        return parse(body, kind)
    except UnicodeDecodeError as exc:  # msgspec's for bad UTF-8 in a string
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


async def read_body(request: Request, limit: int) -> bytearray:
    """The body's bytes (``read_json``'s limit), for a parser that reads JSON itself
    (``lorapool.openai.bodies``)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise _too_large(limit)
    return body


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
