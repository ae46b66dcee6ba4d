"""A streamed response's events, made from the chat job's stream chunks (``format.Shape``'s,
tool calls already parsed by ``tool_stream``), in OpenAI's order:

``response.created``, ``response.in_progress``; for text ``response.output_item.added``
(a message), ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; for each call ``response.output_item.added`` (a
function_call), ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``, ``response.output_item.done``; then
``response.completed`` (``response.incomplete`` at ``max_output_tokens``) or
``response.failed``. Every event has ``type`` and a ``sequence_number`` from 0.
"""

from __future__ import annotations

from typing import Any

from lorapool.openai.responses import (
    ResponseShape,
    call_item,
    item_id,
    message_item,
    usage_of,
)


class ResponseEvents:
    """One response's events: ``start``, ``feed`` each chat chunk, then ``finish``."""

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the text item while it is open
        self.text = ""
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.response: dict[str, Any] | None = None  # the final one

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": f"response.{kind}", "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        response = self.shape.envelope("in_progress", [])
        return [self._event("created", response=response),
                self._event("in_progress", response=response)]  # fmt: skip

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat stream chunk (a usage chunk: none)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.message is None:
            self.message = message_item(item_id("msg"), None, "in_progress")
            self.output.append(self.message)
            events += [
                self._event("output_item.added", output_index=len(self.output) - 1,
                            item={**self.message, "content": []}),
                self._event("content_part.added", **self._at(self.message), content_index=0,
                            part=_part("")),
            ]  # fmt: skip
        self.text += text
        events.append(self._event("output_text.delta", **self._at(self.message),
                                  content_index=0, delta=text, logprobs=[]))  # fmt: skip
        return events

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events, function = [], call.get("function") or {}
        item = self.calls.get(call["index"])
        if item is None:
            events += self._close_text()
            item = call_item(item_id("fc"), call["id"], function["name"], "", "in_progress")
            self.calls[call["index"]] = item
            self.output.append(item)
            events.append(self._event("output_item.added", output_index=len(self.output) - 1,
                                      item=dict(item)))  # fmt: skip
        if arguments := function.get("arguments"):
            item["arguments"] += arguments
            events.append(self._event("function_call_arguments.delta", **self._at(item),
                                      delta=arguments))  # fmt: skip
        return events

    def _close_text(self) -> list[dict[str, Any]]:
        item = self.message
        if item is None:
            return []
        self.message = None
        item["content"] = [_part(self.text)]
        item["status"] = self._status()
        at = self._at(item)
        return [
            self._event("output_text.done", **at, content_index=0, text=self.text, logprobs=[]),
            self._event("content_part.done", **at, content_index=0, part=_part(self.text)),
            self._event("output_item.done", output_index=at["output_index"], item=item),
        ]

    def _status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def finish(self) -> list[dict[str, Any]]:
        """The open items closed, then the response's end."""
        events = self._close_text()
        for item in self.calls.values():
            item["status"] = "completed"
            at = self._at(item)
            events += [
                self._event("function_call_arguments.done", **at, name=item["name"],
                            arguments=item["arguments"]),
                self._event("output_item.done", output_index=at["output_index"], item=item),
            ]  # fmt: skip
        status = self._status()
        self.response = self.shape.envelope(status, self.output, usage_of(self.usage))
        kind = "completed" if status == "completed" else "incomplete"
        return events + [self._event(kind, response=self.response)]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """``response.failed`` with the error (OpenAI's ``{"code", "message"}``)."""
        invalid = error.get("type") == "invalid_request_error"  # the job's input refused
        code = error.get("code") or ("invalid_prompt" if invalid else "server_error")
        failure = {"code": code, "message": error.get("message", "")}
        response = self.shape.envelope("failed", self.output, usage_of(self.usage), failure)
        return [self._event("failed", response=response)]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}
