"""The Responses API over the chat path: a ``ResponsesRequest`` is parsed into the chat
job it asks for (``to_parsed``: the same ``params`` checks, bounds and tools as
``/v1/chat/completions``), and the chat job's reply is shaped as a response
(``ResponseShape``; its stream's events: ``response_events.py``).

A stored conversation (``previous_response_id``) is the chat's messages without the
instructions (OpenAI's: a response's ``instructions`` are not carried to the next).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from lorapool.openai.bodies import ChatRequest, JsonObjectFormat, parse
from lorapool.openai.errors import APIError, bad_request
from lorapool.openai.params import Parsed, chat_parsed
from lorapool.openai.response_bodies import (
    IGNORED_RESPONSES,
    Item,
    JsonSchemaText,
    NamedFunction,
    ResponsesRequest,
    chat_messages,
    items_of,
)

# a chat parameter -> the Responses parameter that set it (for a 400's ``param``)
_RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
            "max_tokens": "max_output_tokens", "response_format": "text"}  # fmt: skip


def to_parsed(
    request: ResponsesRequest, previous: list[dict[str, Any]], tool_parser: str, max_bytes: int
) -> tuple[Parsed, list[dict[str, Any]]]:
    """(the chat job of ``request`` after the stored conversation ``previous``, the
    conversation with this request's input: what the response stores)."""
    if request.background and request.store is False:
        raise bad_request("background responses need store: true (the default)", "background")
    if request.background and request.stream:
        raise bad_request("a background response is not streamed: create it with stream "
                          "false, then poll GET /v1/responses/{id}", "stream")  # fmt: skip
    conversation = previous + chat_messages(items_of(request))
    system = [] if request.instructions is None else [
        {"role": "system", "content": request.instructions}]  # fmt: skip
    chat: dict[str, Any] = {"model": request.model, "messages": system + conversation}
    for name, value in (("max_completion_tokens", request.max_output_tokens),
                        ("temperature", request.temperature), ("top_p", request.top_p),
                        ("user", request.user), ("stream", request.stream),
                        ("parallel_tool_calls", request.parallel_tool_calls)):  # fmt: skip
        if value is not None:
            chat[name] = value
    if request.tools is not None:
        chat["tools"] = [{"type": "function", "function": _function(t)} for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        named = isinstance(choice, NamedFunction)
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}} if named \
            else choice  # fmt: skip
    if (text_format := _response_format(request)) is not None:
        chat["response_format"] = text_format
    try:
        parsed = chat_parsed(parse(chat, ChatRequest), tool_parser, max_bytes)
    except APIError as exc:
        exc.param = _RENAMED.get(exc.param, exc.param)
        raise
    parsed.names = {k: _RENAMED.get(v, v) for k, v in parsed.names.items()}
    parsed.names |= {"prompt": "input", "messages": "input"}  # a worker's refusal of them
    parsed.include_usage = True
    parsed.ignored = [n for n in IGNORED_RESPONSES if getattr(request, n) is not None]
    if request.text is not None and request.text.verbosity is not None:
        parsed.ignored.append("text.verbosity")
    return parsed, conversation


def _function(tool) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.parameters,
                "description": tool.description, "strict": tool.strict}  # fmt: skip
    return {k: v for k, v in function.items() if v is not None}


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    text_format = request.text.format if request.text is not None else None
    if isinstance(text_format, JsonObjectFormat):
        return {"type": "json_object"}
    if isinstance(text_format, JsonSchemaText):
        spec = {"schema": text_format.schema, "name": text_format.name,
                "strict": text_format.strict, "description": text_format.description}  # fmt: skip
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items()
                                                       if v is not None}}  # fmt: skip
    return None


def item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat's ``usage`` in the Responses API's names."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


class ResponseShape:
    """One response's identity and what it echoes of its request."""

    def __init__(self, request: ResponsesRequest, public_id: str, store: bool):
        self.id = f"resp_{public_id}"
        self.request, self.store = request, store
        self.created_at = int(time.time())

    def envelope(self, status: str, output: list[dict], usage=None, error=None) -> dict:
        """The response object (OpenAI's fields) with ``status`` and ``output``."""
        r = self.request
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        text_format = r.text.format if r.text is not None and r.text.format else None
        choice = r.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "background": r.background is True,
            "status": status, "error": error, "incomplete_details": incomplete,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": r.model, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": self.store,
            "temperature": r.temperature, "top_p": r.top_p,
            "text": {"format": msgspec.to_builtins(text_format or {"type": "text"})},
            "tool_choice": msgspec.to_builtins(choice) if choice is not None else "auto",
            "tools": msgspec.to_builtins(r.tools or []), "truncation": "disabled",
            "usage": usage, "user": r.user, "metadata": r.metadata or {},
        }  # fmt: skip

    def of_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The whole response of a chat completion (one choice)."""
        choice = chat["choices"][0]
        message, status = choice["message"], _status(choice["finish_reason"])
        output = []
        if message.get("content"):
            output.append(message_item(item_id("msg"), message["content"], status))
        for call in message.get("tool_calls") or ():
            function = call["function"]
            output.append(call_item(item_id("fc"), call["id"], function["name"],
                                    function["arguments"], "completed"))  # fmt: skip
        return self.envelope(status, output, usage_of(chat.get("usage")))


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(item: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item, "status": status, "role": "assistant",
            "content": content}  # fmt: skip


def call_item(item: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def replied(conversation: list[dict[str, Any]], response: dict[str, Any]) -> list[dict]:
    """``conversation`` with the response's output as the assistant's turn."""
    items = [msgspec.convert(item, Item) for item in response["output"]]
    return conversation + chat_messages(items)
