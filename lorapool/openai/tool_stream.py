"""Tool calls streamed as OpenAI's deltas: ``{"tool_calls": [{"index", "id", "type",
"function": {"name", "arguments"}}]}`` first, then ``{"index", "function": {"arguments":
more text}}`` as the arguments come.

A named function streams its arguments as the model writes them; ``required`` streams
each call of the list as its name and then its arguments appear (``scan_required``
reads the partial list the grammar keeps in the shape ``[{"name":...,"arguments":...}]``);
``auto`` streams content until a call begins, and then its calls, once parsed.
"""

from __future__ import annotations

from typing import Any

from lorapool.openai.tools import ToolRequest
from lorapool.tool_calls import OPEN, PYTHON_TAG, ToolCall, parse_tool_calls, scan_required


class ToolStream:
    """One choice's deltas: ``feed`` each text delta, ``finish`` at its end."""

    def __init__(self, request: ToolRequest):
        self.request = request
        self.text = ""
        self.sent: list[tuple[str, int]] = []  # per call: its id, arguments characters sent
        self.content_sent = 0  # characters of text sent as content (auto)
        self.holding = False  # auto: a call began, the rest waits for the end

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool_call deltas) to send for ``delta``."""
        self.text += delta
        mode = self.request.mode
        if mode == "none":
            return delta, []
        if mode == "named":
            return "", self._calls([(self.request.name, self.text, False)])
        if mode == "required":
            return "", self._calls(scan_required(self.text))
        return self._auto(), []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left to send once the choice has ended."""
        mode = self.request.mode
        if mode == "none":
            return "", []
        if mode == "named":
            return "", self._calls([(self.request.name, self.text, True)])
        if mode == "required":
            return "", self._calls(scan_required(self.text))
        content, calls = parse_tool_calls(self.text, self.request.parser)
        if not calls:
            rest, self.content_sent = self.text[self.content_sent :], len(self.text)
            return rest, []
        return "", self._calls([(c.name, c.arguments, True) for c in calls])

    def _calls(self, calls: list[tuple[str, str, bool]]) -> list[dict[str, Any]]:
        deltas = []
        for index, (name, arguments, _) in enumerate(calls):
            if index == len(self.sent):
                call = ToolCall(name, arguments)
                self.sent.append((call.id, len(arguments)))
                deltas.append(call.to_openai(index))
            elif len(arguments) > self.sent[index][1]:
                more = arguments[self.sent[index][1] :]
                self.sent[index] = (self.sent[index][0], len(arguments))
                deltas.append({"index": index, "function": {"arguments": more}})
        return deltas

    def _auto(self) -> str:
        """Content up to where a call may begin; nothing once one has."""
        if self.holding:
            return ""
        start = _call_start(self.text, self.request.parser)
        if start is not None:
            self.holding = True
            content = self.text[self.content_sent : start]
            self.content_sent = start
            return content
        safe = len(self.text) - _partial_marker(self.text, self.request.parser)
        content = self.text[self.content_sent : safe]
        self.content_sent = max(self.content_sent, safe)
        return content


def _call_start(text: str, parser: str) -> int | None:
    if parser == "llama3_json":
        stripped = text.lstrip()
        if stripped.startswith(("{", PYTHON_TAG)):
            return 0
        return None
    at = text.find(OPEN)
    return None if at < 0 else at


def _partial_marker(text: str, parser: str) -> int:
    """How many trailing characters could be the start of a call marker (held back)."""
    if parser == "llama3_json":  # a call opens the reply, or there is none
        stripped = text.lstrip()
        return len(text) if not stripped or PYTHON_TAG.startswith(stripped) else 0
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
