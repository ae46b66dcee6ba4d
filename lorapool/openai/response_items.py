"""A response's input items as ``GET /v1/responses/{id}/input_items`` lists them: each
item of the request's ``input`` (a string: one user message), with an id (the client's
where it gave one), in OpenAI's item shapes. The instructions are not an item, and a
``previous_response_id``'s items are the previous response's own (OpenAI's).

``page``: OpenAI's cursor list: ``order`` (``desc``, the default, newest first, or
``asc``), ``after`` (an item id of the list: the page starts past it), ``limit`` (1 to
100, default 20); ``first_id``/``last_id`` of the page and ``has_more``.
"""

from __future__ import annotations

from typing import Any

from lorapool.openai.errors import bad_request
from lorapool.openai.response_bodies import (
    FunctionCall,
    InputMessage,
    Item,
    ResponsesRequest,
    items_of,
)
from lorapool.openai.responses import call_item, item_id, message_item

MAX_LIMIT = 100
DEFAULT_LIMIT = 20


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as stored items."""
    return [_item(item) for item in items_of(request)]


def _item(item: Item) -> dict[str, Any]:
    if isinstance(item, InputMessage):
        if item.role == "assistant":
            return message_item(item.id or item_id("msg"), item.text(), "completed")
        content = [{"type": "input_text", "text": item.text()}]
        return {"type": "message", "id": item.id or item_id("msg"), "role": item.role,
                "status": "completed", "content": content}  # fmt: skip
    if isinstance(item, FunctionCall):
        return call_item(item.id or item_id("fc"), item.call_id, item.name, item.arguments,
                         "completed")  # fmt: skip
    output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
    return {"type": "function_call_output", "id": item.id or item_id("fco"),
            "call_id": item.call_id, "output": output, "status": "completed"}  # fmt: skip


def page(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """One page of ``items`` (in input order) for the query's ``limit``/``order``/
    ``after``; 400 naming the parameter that is out of range or unknown."""
    unknown = sorted(set(query) - {"limit", "order", "after", "include", "include[]"})
    if unknown:
        raise bad_request(f"unknown query parameter {unknown[0]!r}", unknown[0])
    limit = _limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', not {order[:32]!r}", "order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if "after" in query:
        ids = [item["id"] for item in ordered]
        if query["after"] not in ids:
            raise bad_request(f"after: no input item {query['after'][:128]!r}", "after")
        start = ids.index(query["after"]) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    if not value.isdigit() or not 1 <= int(value) <= MAX_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIMIT}", "limit")
    return int(value)
