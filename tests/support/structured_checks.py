"""Structured outputs through the gateway with the official ``openai`` client, unchanged:
the checks the tiny-model and SmolLM2 pools both run. Oracles: pydantic (the client's
own parse), jsonschema, ``re.fullmatch``."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import jsonschema
from pydantic import BaseModel, Field


class Pet(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    kind: Literal["cat", "dog", "bird"]
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=3)
    vaccinated: bool


# bounded strings and numbers: a random-weight model under the grammar ends in a few tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "rank": {"type": "integer", "minimum": 1, "maximum": 10},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "rank", "sunny"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
}
ASK = [{"role": "user", "content": "Describe a pet as JSON."}]
MAX_TOKENS = 160


def parse_batch(client, models: list[str]) -> list[Pet]:
    """16 concurrent ``beta.chat.completions.parse`` calls over ``models`` (base and
    adapters), greedy and sampled: each returns a parsed Pet."""

    def one(i: int) -> Pet:
        sampled = i % 2 == 1
        completion = client.beta.chat.completions.parse(
            model=models[i % len(models)],
            messages=ASK,
            response_format=Pet,
            max_tokens=MAX_TOKENS,
            temperature=1.0 if sampled else 0.0,
            seed=i if sampled else None,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, Pet), message.content
        return message.parsed

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(16)))


def json_schema_everywhere(client, model: str) -> None:
    """response_format json_schema (strict) on chat and completions, streamed and not
    (the four calls at once: the worker batches them)."""
    with ThreadPoolExecutor(4) as pool:
        for text, reason in pool.map(lambda f: f(client, model), _SCHEMA_CALLS):
            _valid_json(text, reason)


def _chat(client, model: str, streamed: bool) -> tuple[str, str | None]:
    kw = dict(model=model, messages=ASK, response_format=RESPONSE_FORMAT, max_tokens=MAX_TOKENS)
    if not streamed:
        got = client.chat.completions.create(**kw)
        return got.choices[0].message.content, got.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, temperature=1.0, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def _completion(client, model: str, streamed: bool) -> tuple[str, str | None]:
    got = client.completions.create(
        model=model,
        prompt="Weather report as JSON:",
        max_tokens=MAX_TOKENS,
        stream=streamed,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    if not streamed:
        return got.choices[0].text, got.choices[0].finish_reason
    chunks = list(got)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)


_SCHEMA_CALLS = [
    lambda c, m: _chat(c, m, False),
    lambda c, m: _chat(c, m, True),
    lambda c, m: _completion(c, m, False),
    lambda c, m: _completion(c, m, True),
]


def _valid_json(text: str, finish_reason: str | None) -> None:
    assert finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


def guided_extras(client, model: str) -> None:
    """vLLM's guided_choice and guided_regex through ``extra_body``, chat and completions."""
    choices = ["sunny", "cloudy", "rainy"]
    got = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather?"}],
        max_tokens=20,
        temperature=1.0,
        n=3,
        extra_body={"guided_choice": choices},
    )
    assert len(got.choices) == 3
    assert all(c.message.content in choices for c in got.choices)
    pattern = r"[A-Z]{2}-[0-9]{3,4}"
    got = client.completions.create(
        model=model,
        prompt="Flight number:",
        max_tokens=20,
        temperature=1.0,
        extra_body={"guided_regex": pattern},
    )
    assert re.fullmatch(pattern, got.choices[0].text), got.choices[0].text
    got = client.completions.create(
        model=model,
        prompt="Flight number:",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, got.choices[0].text), got.choices[0].text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TOOL_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid_calls(calls, names=None) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    """OpenAI's tool_call deltas joined as a client joins them: by index."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    return calls, reason, content


def tool_calls_forced(client, model: str) -> None:
    """tool_choice "required" and a named function, streamed and not: every call's
    arguments validate against its function's parameters. (One call a reply: a random
    model free to add calls to the list adds them until max_tokens.)"""
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names, reason in (("required", None, "tool_calls"), (named, {"get_time"}, "stop")):
        got = client.chat.completions.create(
            model=model,
            messages=TOOL_ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=MAX_TOKENS,
            parallel_tool_calls=False,
        )
        message = got.choices[0].message
        assert got.choices[0].finish_reason == reason, message
        _valid_calls(message.tool_calls, names)
        assert message.content is None
        stream = client.chat.completions.create(
            model=model,
            messages=TOOL_ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=MAX_TOKENS,
            stream=True,
            temperature=1.0,
            seed=5,
            parallel_tool_calls=False,
        )
        calls, streamed_reason, content = _streamed_calls(stream)
        assert streamed_reason == reason and content == ""
        for call in calls.values():
            assert call["id"].startswith("call_")
            assert names is None or call["name"] in names
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert calls


def tool_conversation(client, model: str) -> None:
    """A call, its result as a role "tool" message, and the model's answer."""
    first = client.chat.completions.create(
        model=model,
        messages=TOOL_ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        parallel_tool_calls=False,
    )
    message = first.choices[0].message
    messages = [*TOOL_ASK, message.model_dump(exclude_none=True)]
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'})
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")
