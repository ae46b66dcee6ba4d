"""The Responses API's request (``POST /v1/responses``) as msgspec Structs, and its
input as the chat a job carries: a response is a chat job (``responses.py``).

``input``: a string (one user message) or items: messages (``type`` ``message``, which
OpenAI lets a client leave out; content a string or ``input_text``/``output_text``
parts), an assistant's ``function_call`` and the client's ``function_call_output``.
Tools are function tools; ``text.format`` is text, ``json_object`` or ``json_schema``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from lorapool.openai.bodies import IGNORED_DOC, MAX_USER, JsonObjectFormat, NameText, TextFormat
from lorapool.openai.errors import bad_request
from lorapool.records.bounds import Count, Temperature, TopP


class InputText(Struct, tag="input_text", tag_field="type"):
    text: str


class OutputText(Struct, tag="output_text", tag_field="type", kw_only=True):
    text: str
    annotations: Any = None  # a reply's, sent back with it: dropped
    logprobs: Any = None


class InputMessage(Struct, tag="message", tag_field="type", kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | OutputText]
    id: str | None = None  # an output item's, sent back with it
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCall(Struct, tag="function_call", tag_field="type", kw_only=True):
    """A call the model made (an output item, sent back as input)."""

    call_id: NameText
    name: NameText
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(Struct, tag="function_call_output", tag_field="type", kw_only=True):
    """The client's result of a call."""

    call_id: NameText
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


Item = InputMessage | FunctionCall | FunctionCallOutput


class FunctionTool(Struct, tag="function", tag_field="type", kw_only=True):
    name: NameText
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class NamedFunction(Struct, tag="function", tag_field="type"):
    name: NameText


class JsonSchemaText(Struct, tag="json_schema", tag_field="type", kw_only=True):
    """``text.format`` of a JSON schema (chat's ``json_schema``, its fields flat)."""

    schema: dict[str, Any]
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True):
    format: TextFormat | JsonObjectFormat | JsonSchemaText | None = None
    verbosity: Annotated[str, Meta(description=IGNORED_DOC)] | None = None


class ResponsesRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/responses: a chat job; ``store`` (true by default, OpenAI's) keeps the
    response for ``GET /v1/responses/{id}`` and ``previous_response_id``."""

    model: Annotated[str, Meta(min_length=1)]
    input: Annotated[str | list[dict[str, Any]], Meta(description="a user message, or input items")]
    instructions: Annotated[str, Meta(description="a system message, not carried on")] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    max_output_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Annotated[dict[str, str], Meta(description="echoed in the response")] | None = None
    user: Annotated[str, Meta(max_length=MAX_USER)] | None = None
    # accepted and ignored (named in the reply's header): they do not change the output
    reasoning: Annotated[dict[str, Any], Meta(description=IGNORED_DOC)] | None = None
    truncation: Annotated[str, Meta(description=IGNORED_DOC)] | None = None
    include: Annotated[list[str], Meta(description=IGNORED_DOC)] | None = None
    service_tier: Annotated[str, Meta(description=IGNORED_DOC)] | None = None
    prompt_cache_key: Annotated[str, Meta(description=IGNORED_DOC)] | None = None
    safety_identifier: Annotated[str, Meta(description=IGNORED_DOC)] | None = None
    max_tool_calls: Annotated[int, Meta(description=IGNORED_DOC)] | None = None
    top_logprobs: Annotated[int, Meta(description=IGNORED_DOC)] | None = None
    background: Annotated[bool, Meta(description="answer at once, queued; poll GET")] | None = None
    # what would change the output and is not served
    conversation: Annotated[None, Meta(description="not supported")] = None
    prompt: Annotated[None, Meta(description="not supported")] = None


IGNORED_RESPONSES = ("reasoning", "truncation", "include", "service_tier", "prompt_cache_key",
                     "safety_identifier", "max_tool_calls", "top_logprobs")  # fmt: skip


def items_of(request: ResponsesRequest) -> list[Item]:
    """``input`` as items (a string: one user message); 400 naming ``input[i]``."""
    if isinstance(request.input, str):
        return [InputMessage(role="user", content=request.input)]
    items = []
    for i, value in enumerate(request.input):
        if "type" not in value:  # OpenAI's EasyInputMessage: a message without its type
            value = {**value, "type": "message"}
        try:
            items.append(msgspec.convert(value, Item))
        except msgspec.ValidationError as exc:
            raise bad_request(f"input[{i}]: {exc}", "input") from None
    if not items:
        raise bad_request("input must be a non-empty string or list of items", "input")
    return items


def chat_messages(items: list[Item]) -> list[dict[str, Any]]:
    """The items as a chat's messages (job form): a developer message as a system one,
    consecutive function calls as one assistant message's tool calls, a call's output
    as the tool message answering it."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, InputMessage):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        else:
            output = item.output
            text = output if isinstance(output, str) else "".join(p.text for p in output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
    return messages
