"""A chat request's tools: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (OpenAI's),
and the reply's ``tool_calls``.

``tool_choice``: ``none`` (the reply is content), ``auto`` (the default with tools: the
model's text is parsed for calls by its family's parser, ``lorapool.tool_calls``),
``required`` (a structured output forces a list of calls to the tools, each one's
arguments valid for its parameters schema) or ``{"type": "function", "function":
{"name"}}`` (a structured output forces that function's arguments).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorapool.openai.bodies import NamedToolChoice, ToolChoice
from lorapool.openai.errors import bad_request
from lorapool.protocol import FieldError
from lorapool.records.messages import check_tools
from lorapool.records.structured import StructuredOutputsParams
from lorapool.tool_calls import ToolCall, parse_tool_calls, required_schema, scan_required


@dataclass
class ToolRequest:
    """What a chat asks of tools; ``mode``: none, auto, required or named."""

    tools: list[dict[str, Any]]
    mode: str
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str = "hermes"
    constraint: StructuredOutputsParams | None = field(default=None, repr=False)
    legacy: bool = False  # asked as ``functions``: the reply's ``function_call``

    def reply(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of one choice's whole text."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            return None, [ToolCall(n, a) for n, a, complete in scan_required(text) if complete]
        if self.mode == "auto":
            return parse_tool_calls(text, self.parser)
        return text, []

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        """OpenAI's: ``tool_calls`` when the model chose to call, ``stop`` for a named one."""
        if calls and reason == "stop" and self.mode != "named":
            return "function_call" if self.legacy else "tool_calls"
        return reason


def tools_of(request, max_bytes: int, parser: str) -> ToolRequest | None:
    """The ToolRequest of ``request`` (a ``bodies.ChatRequest``; None without tools); 400
    naming the bad parameter."""
    tools, choice = request.tools, request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    try:
        tools = check_tools(tools, max_bytes, chat=True)
    except FieldError as exc:
        raise bad_request(str(exc), "tools") from None
    parallel = request.parallel_tool_calls is not False
    wanted = ToolRequest(tools, *_mode(choice, tools), parallel, parser)
    wanted.constraint = _constraint(wanted)
    return wanted


def _mode(choice: ToolChoice | None, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if not isinstance(choice, NamedToolChoice):
        return choice or "auto", None
    name = choice.function.name
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return "named", name


def _constraint(request: ToolRequest) -> StructuredOutputsParams | None:
    if request.mode == "named":
        [tool] = [t for t in request.tools if t["function"]["name"] == request.name][:1]
        schema = tool["function"].get("parameters") or {"type": "object"}
    elif request.mode == "required":
        schema = required_schema(request.tools, request.parallel)
    else:
        return None
    try:
        return StructuredOutputsParams(json=schema)
    except FieldError as exc:
        message = f"tools: a function's parameters do not compile: {exc}"
        raise bad_request(message, "tools") from None
