"""OpenAI's legacy function calling: a chat's ``functions`` and ``function_call`` as the
``tools`` and ``tool_choice`` that replaced them, one call at most (the reply carries
``message.function_call`` and finish_reason ``function_call``: ``format.py``). A
conversation's legacy turns become tool calls and tool messages in ``Message.to_job``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from lorapool.openai.bodies import ChatRequest, FunctionName, NamedToolChoice
from lorapool.openai.errors import bad_request


def legacy_functions(request: ChatRequest) -> ChatRequest:
    """``request`` with its ``functions``/``function_call`` as tools (no parallel calls);
    400 naming the parameter when they are mixed with tools or given alone."""
    functions, choice = request.functions, request.function_call
    if functions is None:
        if choice is not None:
            raise bad_request("function_call needs functions", "function_call")
        return request
    if request.tools is not None or request.tool_choice is not None:
        raise bad_request("give functions or tools, not both", "functions")
    tools = [{"type": "function", "function": _function(f)} for f in functions]
    if isinstance(choice, FunctionName):
        choice = NamedToolChoice("function", choice)
    return msgspec.structs.replace(
        request, tools=tools, tool_choice=choice, parallel_tool_calls=False,
        functions=None, function_call=None,
    )  # fmt: skip


def _function(function: Any) -> dict[str, Any]:
    return {k: v for k, v in msgspec.to_builtins(function).items() if v is not None}


def legacy_delta(calls: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The stream's ``function_call`` delta of tool-call deltas (the first call's only)."""
    first = [c["function"] for c in calls if c.get("index", 0) == 0]
    if not first:
        return None
    return {k: first[0][k] for k in ("name", "arguments") if k in first[0]}
