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
    """response_format json_schema (strict) on chat and completions, streamed and not."""
    chat = client.chat.completions.create(
        model=model, messages=ASK, response_format=RESPONSE_FORMAT, max_tokens=MAX_TOKENS
    )
    _valid_json(chat.choices[0].message.content, chat.choices[0].finish_reason)
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        response_format=RESPONSE_FORMAT,
        max_tokens=MAX_TOKENS,
        stream=True,
        temperature=1.0,
    )
    text, reason = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    _valid_json(text, reason)
    for streamed in (False, True):
        extra = {"response_format": RESPONSE_FORMAT}
        got = client.completions.create(
            model=model,
            prompt="Weather report as JSON:",
            max_tokens=MAX_TOKENS,
            stream=streamed,
            extra_body=extra,
        )
        if streamed:
            chunks = list(got)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
        else:
            text, reason = got.choices[0].text, got.choices[0].finish_reason
        _valid_json(text, reason)


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
