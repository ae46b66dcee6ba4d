"""Tool calls in a model's text: how a chat offers tools to a template that has no place
for them, the schema that forces a call, and a parser per model family. Torch-free.

Families (vLLM's parser names):
- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
  call (Qwen 2.5 and 3, Hermes, and SmolLM2, whose blocks may hold a list of calls);
- ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``), several calls separated by ``;`` (Llama 3.1 - 3.3).

``parser_for(model_name)`` picks one from the base model's name (hermes unless it names
Llama); ``lorapool serve --tool-call-parser`` overrides it.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PARSERS = ("hermes", "llama3_json")


@dataclass
class ToolCall:
    """One call as OpenAI's API returns it (``arguments``: JSON text)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return call if index is None else {"index": index, **call}


def parser_for(model_name: str | None) -> str:
    return "llama3_json" if "llama" in (model_name or "").lower() else "hermes"


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(the content left, the calls) of a reply; no calls: (text, [])."""
    if parser == "llama3_json":
        return _llama3_json(text)
    return _hermes(text)


def _hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    if OPEN not in text:
        return text, []
    calls: list[ToolCall] = []
    for block in re.findall(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", text, re.S):
        try:
            value = json.loads(block)
        except ValueError:
            return text, []
        for item in value if isinstance(value, list) else [value]:
            call = _call(item, "arguments")
            if call is None:
                return text, []
            calls.append(call)
    content = text[: text.index(OPEN)].strip()
    return content or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call(value, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return None, calls


def _call(value: Any, key: str) -> ToolCall | None:
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    arguments = value.get(key, value.get("arguments", {}))
    if isinstance(arguments, str):
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], compact(arguments))


def compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


_HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def scan_required(text: str) -> list[tuple[str, str, bool]]:
    """(name, arguments text so far, complete) of each call of a partial JSON list."""
    calls, at = [], 0
    while (head := _HEAD.match(text, at)) is not None:
        name = json.loads(f'"{head.group(1)}"')
        end = _value_end(text, head.end())
        if end is None:
            calls.append((name, text[head.end() :], False))
            break
        calls.append((name, text[head.end() : end], True))
        close = re.compile(r"\s*\}").match(text, end)
        if close is None:
            break
        at = close.end()
    return calls


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at ``start`` ends (None: not yet complete)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
            if depth < 0:
                return i
        elif ch == "," and depth == 0:
            return i
    return None


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema a reply follows under ``tool_choice="required"``: a list of calls
    ``[{"name": one of the tools, "arguments": its parameters}, ...]``."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def renders_tools(chat_template: Any) -> bool:
    """Whether a chat template has a place for tools (else ``plain_chat`` describes them)."""
    if isinstance(chat_template, dict):
        return "tool_use" in chat_template
    return isinstance(chat_template, str) and "tools" in chat_template


def template_chat(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools: each call's arguments as an object,
    as Hugging Face templates expect (``tool_call.arguments | tojson``)."""
    return [
        {**m, "tool_calls": [_template_call(c) for c in m["tool_calls"]]}
        if "tool_calls" in m
        else m
        for m in messages
    ]


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    with contextlib.suppress(ValueError, TypeError):
        function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


def plain_chat(messages: list[dict[str, Any]], tools: list | None) -> list[dict[str, Any]]:
    """The chat for a template with no place for tools: the tools described in the system
    message, calls and results written as text in the hermes format."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            blocks = [_block(c["function"]) for c in m["tool_calls"]]
            content = "\n".join(filter(None, [content, *blocks]))
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    if tools:
        system = _describe(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _block(function: dict[str, Any]) -> str:
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, TypeError):
        arguments = function["arguments"]
    return f"{OPEN}\n{compact({'name': function['name'], 'arguments': arguments})}\n{CLOSE}"


def _describe(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(compact(t["function"]) for t in tools)
    return (
        "You may call one or more functions to answer. The functions:\n"
        f"<tools>\n{listed}\n</tools>\n"
        f'To call one, reply with {OPEN}{{"name": <name>, "arguments": <arguments object>}}'
        f"{CLOSE}, one block per call."
    )
