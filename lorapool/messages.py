"""A chat job's ``messages`` and ``tools``: the one check of their shape and size. Torch-free.

The gateway needs no tokenizer: a chat job carries its messages (and the tools it
offers), and the worker applies the model's chat template (``lorapool.worker.prompt``).

A message has a ``role`` and ``content`` (a string; an assistant message that calls
tools may have none), and, as OpenAI's API sends them, an assistant's ``tool_calls``
(``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]``) and a
tool message's ``tool_call_id``, and a ``name``.
"""

from __future__ import annotations

from typing import Any

import orjson

from lorapool.bounds import MAX_MESSAGES, MAX_NAME, MAX_ROLE, MAX_TOOL_CALLS, MAX_TOOLS
from lorapool.protocol import FieldError, short_repr

_MESSAGE_FIELDS = frozenset(("role", "content", "name", "tool_calls", "tool_call_id"))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise FieldError(message)


def check_messages(messages: Any, max_prompt_bytes: int) -> list[dict[str, Any]] | None:
    """The messages of a chat (None: not a chat), or FieldError naming the bad field.

    1 to MAX_MESSAGES objects (the fields above); their UTF-8 size counts against
    ``max_prompt_bytes`` as a prompt's does.
    """
    if messages is None:
        return None
    if not (isinstance(messages, list) and 0 < len(messages) <= MAX_MESSAGES):
        raise FieldError(
            f"messages must be a list of 1 to {MAX_MESSAGES} messages, got {short_repr(messages)}"
        )
    checked = [_message(i, m) for i, m in enumerate(messages)]
    size = sum(size for _, size in checked)
    _check(
        size <= max_prompt_bytes,
        f"the prompt is {size} bytes, over the limit of {max_prompt_bytes} (max_prompt_bytes)",
    )
    return [m for m, _ in checked]


def _message(i: int, message: Any) -> tuple[dict[str, Any], int]:
    if not (isinstance(message, dict) and "role" in message and set(message) <= _MESSAGE_FIELDS):
        raise FieldError(
            f"messages[{i}] must be an object with 'role', 'content' and optionally "
            f"'name', 'tool_calls' or 'tool_call_id', got {short_repr(message)}"
        )
    role, content = message["role"], message.get("content")
    if not (isinstance(role, str) and 0 < len(role) <= MAX_ROLE and "\x00" not in role):
        raise FieldError(
            f"messages[{i}].role must be a non-empty string of at most {MAX_ROLE} characters "
            f"without NUL, got {short_repr(role)}"
        )
    calls = message.get("tool_calls")
    if content is None and calls is None:
        raise FieldError(f"messages[{i}].content must be a string, got None")
    if not (content is None or isinstance(content, str)):
        raise FieldError(f"messages[{i}].content must be a string, got {short_repr(content)}")
    size = len(role) + utf8_size(content or "", f"messages[{i}].content")
    out: dict[str, Any] = {"role": role, "content": content or ""}
    for name in ("name", "tool_call_id"):
        if message.get(name) is not None:
            out[name] = _short_text(message[name], f"messages[{i}].{name}")
            size += len(out[name])
    if calls is not None:
        where = f"messages[{i}].tool_calls"
        calls = _list(calls, where, MAX_TOOL_CALLS)
        out["tool_calls"] = [_tool_call(f"{where}[{j}]", c) for j, c in enumerate(calls)]
        size += len(orjson.dumps(out["tool_calls"]))
    return out, size


def _list(value: Any, what: str, most: int) -> list:
    if not (isinstance(value, list) and len(value) <= most):
        raise FieldError(f"{what} must be a list of at most {most}, got {short_repr(value)}")
    return value


def _short_text(value: Any, what: str) -> str:
    if not (isinstance(value, str) and 0 < len(value) <= MAX_NAME and "\x00" not in value):
        raise FieldError(
            f"{what} must be a non-empty string of at most {MAX_NAME} characters without NUL, "
            f"got {short_repr(value)}"
        )
    return value


def _tool_call(what: str, call: Any) -> dict[str, Any]:
    """``{"id", "type": "function", "function": {"name", "arguments"}}``, arguments text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise FieldError(
            f"{what} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}"
        )
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise FieldError(f"{what}.function.arguments must be a string (JSON)")
    utf8_size(arguments, f"{what}.function.arguments")
    out = {"type": "function", "function": {
        "name": _short_text(function.get("name"), f"{what}.function.name"),
        "arguments": arguments,
    }}  # fmt: skip
    if call.get("id") is not None:
        out["id"] = _short_text(call["id"], f"{what}.id")
    return out


def check_tools(tools: Any, max_prompt_bytes: int, chat: bool) -> list[dict[str, Any]] | None:
    """The tools a chat offers (OpenAI's ``[{"type": "function", "function": {"name",
    "description", "parameters"}}]``, for the chat template), or FieldError."""
    if tools is None:
        return None
    _check(chat, "tools need messages (a chat)")
    for i, tool in enumerate(_list(tools, "tools", MAX_TOOLS)):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise FieldError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        _short_text(function.get("name"), f"tools[{i}].function.name")
        if not isinstance(function.get("parameters", {}), dict):
            raise FieldError(f"tools[{i}].function.parameters must be an object (a JSON schema)")
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
            f"{what} is not valid Unicode text ({exc.reason} at position {exc.start})"
        ) from None
