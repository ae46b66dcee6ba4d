"""A chat job's ``messages`` and ``tools``: the one check of their shape and size. Torch-free.

The gateway needs no tokenizer: a chat job carries its messages (and the tools it
offers), and the worker applies the model's chat template (``lorapool.worker.prompt``).

A message has a ``role`` and ``content`` (a string; an assistant message that calls
tools may have none), and, as OpenAI's API sends them, an assistant's ``tool_calls``
(``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]``) and a
tool message's ``tool_call_id``, and a ``name``.

``check_messages`` runs every job twice a life (submit, the worker's decode), so it
checks in one cheap pass: bounds' lengths in msgspec and a NUL scan of each message's
role and names in Python (bounds' no-NUL pattern is a regex search a string, which cost
more than the rest of the check). Only a refused chat meets the second pass, with
bounds' own types, so that its refusal is worded and ordered as msgspec words it.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, TypeVar

import msgspec
import orjson

from lorapool.records.bounds import (
    MAX_MESSAGES,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    Role,
    ShortName,
    bounds_of,
)
from lorapool.records.errors import FieldError, check, invalid

# The types of a message's role and of its names (its own, a tool call's id, a function's
# name): bounds' Role and ShortName, or their lengths alone on the fast path (``_Lengths``).
RoleT = TypeVar("RoleT")
NameT = TypeVar("NameT")
_AT_MOST_CALLS = msgspec.Meta(max_length=MAX_TOOL_CALLS)
_ONE_TO_MAX_MESSAGES = msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)


class ToolFunction(msgspec.Struct, Generic[NameT], forbid_unknown_fields=True):
    """The function an assistant's tool call names, and its arguments as JSON text."""

    name: NameT
    arguments: str = "{}"


class ToolCall(msgspec.Struct, Generic[NameT], forbid_unknown_fields=True):
    """An assistant's call of a tool (``type`` "function", the only kind)."""

    function: ToolFunction[NameT]
    type: str = "function"
    id: NameT | None = None


class Message(msgspec.Struct, Generic[RoleT, NameT], forbid_unknown_fields=True):
    """One message of a chat job (OpenAI's fields; content None only beside tool_calls)."""

    role: RoleT
    content: str | None = None
    name: NameT | None = None
    tool_calls: Annotated[list[ToolCall[NameT]], _AT_MOST_CALLS] | None = None
    tool_call_id: NameT | None = None


class Chat(msgspec.Struct, Generic[RoleT, NameT]):
    """A chat's messages, as a record: msgspec keeps a Struct's parsed types on its class,
    where ``convert(value, list[...])`` parses the list's type every call (~1.4 µs of a
    4-message chat's check, ``benchmarks/messages_check.py``)."""

    messages: Annotated[list[Message[RoleT, NameT]], _ONE_TO_MAX_MESSAGES]


def _lengths(text: Any) -> Any:
    """A bounds text type without its no-NUL ``pattern``: the lengths msgspec checks in C,
    where a pattern costs a Python regex search a string (~0.33 µs)."""
    bounds = {k: v for k, v in bounds_of(text).items() if k != "pattern"}
    return Annotated[str, msgspec.Meta(**bounds)]


class _Bounded(Chat[Role, ShortName]):
    """The messages with bounds' own types: the check as it is written."""


class _Lengths(Chat[_lengths(Role), _lengths(ShortName)]):
    """The same with a NUL in a role or a name left to ``_message``'s scan."""


class ToolSpec(msgspec.Struct):
    """The function a tool offers: a name, and its parameters' JSON schema (an object);
    other fields (description, strict) go to the chat template as they are."""

    name: ShortName
    parameters: dict[str, Any] | None = None


class Tool(msgspec.Struct):
    type: str
    function: ToolSpec


class Tools(msgspec.Struct):
    """A chat's tools, as a record (a Struct's types are parsed once, as ``Chat``'s)."""

    tools: Annotated[list[Tool], msgspec.Meta(max_length=MAX_TOOLS)]


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
    wrapped = {"messages": messages}
    try:
        checked, size = _checked(msgspec.convert(wrapped, _Lengths, strict=True))
    except Exception:  # noqa: BLE001 - the check below decides: it raises, as it always has
        # Refused (by msgspec, a check, or a lone surrogate's error in msgspec or orjson):
        # again with bounds' own types, so the refusal is the first fault msgspec meets,
        # NUL or not; both passes accept the same messages, and return the same dicts.
        checked, size = _checked(_typed(wrapped, _Bounded, ""))
    if size > max_prompt_bytes:
        raise FieldError(
            f"the prompt is {size} bytes, over the limit of {max_prompt_bytes} (max_prompt_bytes)",
            field="messages",
        )
    return checked


def _checked(chat: Chat) -> tuple[list[dict[str, Any]], int]:
    """The messages as dicts, and their size."""
    out, size = [], 0
    for i, message in enumerate(chat.messages):
        as_dict, message_size = _message(i, message)
        out.append(as_dict)
        size += message_size
    return out, size


def _message(i: int, message: Message) -> tuple[dict[str, Any], int]:
    """The message as a dict, and its size; error messages are built only on a refusal."""
    role, content, calls = message.role, message.content, message.tool_calls
    if content is None:
        if calls is None:
            field = f"messages[{i}].content"
            raise FieldError(f"{field} must be a string, got None", field=field)
        content = ""
    size = len(role) + (
        len(content) if content.isascii() else utf8_size(content, f"messages[{i}].content")
    )
    out: dict[str, Any] = {"role": role, "content": content}
    names = role
    if (name := message.name) is not None:
        out["name"] = name
        size += len(name)
        names += name
    if (call_id := message.tool_call_id) is not None:
        out["tool_call_id"] = call_id
        size += len(call_id)
        names += call_id
    _no_nul(names, i)
    if calls is not None:
        out["tool_calls"] = dicts = []
        for j, call in enumerate(calls):
            dicts.append(_tool_call(i, j, call))
        size += len(orjson.dumps(dicts))
    return out, size


def _tool_call(i: int, j: int, call: ToolCall) -> dict[str, Any]:
    """``{"type": "function", "function": {"name", "arguments"}, "id"}``, arguments text."""
    if call.type != "function":
        field = f"messages[{i}].tool_calls[{j}].type"
        raise FieldError(f"{field} must be 'function', got {call.type!r}", field=field)
    function = call.function
    name, arguments = function.name, function.arguments
    if not arguments.isascii():
        utf8_size(arguments, f"messages[{i}].tool_calls[{j}].function.arguments")
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.id is not None:
        out["id"] = call.id
        name += call.id
    _no_nul(name, i)
    return out


def _no_nul(names: str, i: int) -> None:
    """FieldError for a NUL in a message's role or names; only one that ``_Lengths``
    let through can hold one here, and ``check_messages`` then words the refusal."""
    if "\x00" in names:
        raise FieldError(f"messages[{i}] has a NUL in its role or a name", field=f"messages[{i}]")


def check_tools(tools: Any, max_prompt_bytes: int, chat: bool) -> list[dict[str, Any]] | None:
    """The tools a chat offers (OpenAI's ``[{"type": "function", "function": {"name",
    "description", "parameters"}}]``, for the chat template, as given), or FieldError."""
    if tools is None:
        return None
    check(chat, "tools need messages (a chat)", "tools")
    for i, tool in enumerate(_typed({"tools": tools}, Tools, "").tools):
        check(tool.type == "function", f"tools[{i}].type must be 'function'", f"tools[{i}].type")
    check_json_size(tools, "tools", max_prompt_bytes, " (max_prompt_bytes)")
    return tools


def check_json_size(value: Any, what: str, limit: int, limit_name: str = "") -> None:
    """FieldError naming ``what`` unless ``value`` encodes as JSON (string keys) in at
    most ``limit`` bytes (``limit_name``: the setting it comes from, for the message)."""
    try:
        size = len(orjson.dumps(value))
    except orjson.JSONEncodeError as exc:
        raise FieldError(f"{what} must be JSON with string keys: {exc}", field=what) from None
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
