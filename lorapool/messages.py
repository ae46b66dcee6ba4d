"""A chat job's ``messages`` and ``tools``: the one check of their shape and size. Torch-free.

The gateway needs no tokenizer: a chat job carries its messages (and the tools it
offers), and the worker applies the model's chat template (``lorapool.worker.prompt``).

A message has a ``role`` and ``content`` (a string; an assistant message that calls
tools may have none), and, as OpenAI's API sends them, an assistant's ``tool_calls``
(``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]``) and a
tool message's ``tool_call_id``, and a ``name``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import orjson

from lorapool.bounds import MAX_MESSAGES, MAX_TOOL_CALLS, MAX_TOOLS, Role, ShortName
from lorapool.field_errors import FieldError, check, invalid


class ToolFunction(msgspec.Struct, forbid_unknown_fields=True):
    """The function an assistant's tool call names, and its arguments as JSON text."""

    name: ShortName
    arguments: str = "{}"


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """An assistant's call of a tool (``type`` "function", the only kind)."""

    function: ToolFunction
    type: str = "function"
    id: ShortName | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """One message of a chat job (OpenAI's fields; content None only beside tool_calls)."""

    role: Role
    content: str | None = None
    name: ShortName | None = None
    tool_calls: Annotated[list[ToolCall], msgspec.Meta(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: ShortName | None = None


Messages = Annotated[list[Message], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]


class ToolSpec(msgspec.Struct):
    """The function a tool offers: a name, and its parameters' JSON schema (an object);
    other fields (description, strict) go to the chat template as they are."""

    name: ShortName
    parameters: dict[str, Any] | None = None


class Tool(msgspec.Struct):
    type: str
    function: ToolSpec


Tools = Annotated[list[Tool], msgspec.Meta(max_length=MAX_TOOLS)]


def _typed(value: Any, tp: Any, root: str) -> Any:
    """``value`` as ``tp``; the FieldError naming the field msgspec refuses."""
    try:
        return msgspec.convert(value, tp, strict=True)
    except msgspec.ValidationError as exc:
        raise invalid(exc, value, tp, root) from None


def check_messages(messages: Any, max_prompt_bytes: int) -> list[dict[str, Any]] | None:
    """The messages of a chat (None: not a chat) as the worker's chat template takes
    them (content "" where None), or FieldError naming the bad field.

    1 to MAX_MESSAGES ``Message``s; their UTF-8 size counts against ``max_prompt_bytes``
    as a prompt's does.
    """
    if messages is None:
        return None
    checked = [_message(i, m) for i, m in enumerate(_typed(messages, Messages, "messages"))]
    size = sum(size for _, size in checked)
    check(
        size <= max_prompt_bytes,
        f"the prompt is {size} bytes, over the limit of {max_prompt_bytes} (max_prompt_bytes)",
        "messages",
    )
    return [m for m, _ in checked]


def _message(i: int, message: Message) -> tuple[dict[str, Any], int]:
    where = f"messages[{i}]"
    calls = message.tool_calls
    if message.content is None and calls is None:
        raise FieldError(f"{where}.content must be a string, got None", field=f"{where}.content")
    content = message.content or ""
    size = len(message.role) + utf8_size(content, f"{where}.content")
    out: dict[str, Any] = {"role": message.role, "content": content}
    for name in ("name", "tool_call_id"):
        if (value := getattr(message, name)) is not None:
            out[name] = value
            size += len(value)
    if calls is not None:
        out["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
        size += len(orjson.dumps(out["tool_calls"]))
    return out, size


def _tool_call(where: str, call: ToolCall) -> dict[str, Any]:
    """``{"type": "function", "function": {"name", "arguments"}, "id"}``, arguments text."""
    check(
        call.type == "function",
        f"{where}.type must be 'function', got {call.type!r}",
        f"{where}.type",
    )
    utf8_size(call.function.arguments, f"{where}.function.arguments")
    out = {"type": "function", "function": {
        "name": call.function.name, "arguments": call.function.arguments,
    }}  # fmt: skip
    if call.id is not None:
        out["id"] = call.id
    return out


def check_tools(tools: Any, max_prompt_bytes: int, chat: bool) -> list[dict[str, Any]] | None:
    """The tools a chat offers (OpenAI's ``[{"type": "function", "function": {"name",
    "description", "parameters"}}]``, for the chat template, as given), or FieldError."""
    if tools is None:
        return None
    check(chat, "tools need messages (a chat)", "tools")
    for i, tool in enumerate(_typed(tools, Tools, "tools")):
        check(tool.type == "function", f"tools[{i}].type must be 'function'", f"tools[{i}].type")
    check_json_size(tools, "tools", max_prompt_bytes, " (max_prompt_bytes)")
    return tools


def check_json_size(value: Any, what: str, limit: int, limit_name: str = "") -> None:
    """FieldError naming ``what`` unless ``value`` encodes as JSON (string keys) in at
    most ``limit`` bytes (``limit_name``: the setting it comes from, for the message)."""
    try:
        size = len(orjson.dumps(value))
    except orjson.JSONEncodeError as exc:
        raise FieldError(f"{what} must be JSON with string keys: {exc}") from None
    if size > limit:
        raise FieldError(f"{what} is {size} bytes as JSON, over the limit of {limit}{limit_name}")


def utf8_size(text: str, what: str) -> int:
    """Bytes of ``text`` in UTF-8; FieldError naming ``what`` for lone surrogates.

    ASCII text (CPython keeps the flag: O(1)) is its length, without encoding a copy:
    a copy of a fresh megabyte string costs a worker hundreds of µs a job in page
    faults (``benchmarks/job_decode.py``, a 500 KB prompt)."""
    if text.isascii():
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise FieldError(
            f"{what} is not valid Unicode text ({exc.reason} at position {exc.start})", field=what
        ) from None
