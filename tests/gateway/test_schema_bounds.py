"""The request bodies' OpenAPI description is their parser: every bound the document shows
(``lorapool.openai.bodies``' Structs, through ``schema_components``) is what a request
meets. A value at the shown bound is accepted by the whole parse (the Struct, then the
job boundary's ``SamplingParams``), one just past it is a 400 naming the parameter.
"""

import math

import jsonschema
import pytest

from lorapool.lifecycle.submit import MAX_ON_FINISH
from lorapool.openai.bodies import MAX_USER, parse, schema_components
from lorapool.openai.errors import APIError
from lorapool.openai.params import parse_chat, parse_completion, parse_job
from lorapool.openai.response_bodies import ResponsesRequest
from lorapool.openai.responses import to_parsed
from lorapool.protocol import PENALTY_MAX
from lorapool.records.bounds import MAX_REQUEST_ID

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
PARSERS = {
    "CompletionRequest": (lambda b: parse_completion(b, 1), {"model": "m", "prompt": "hi"}),
    "ChatRequest": (parse_chat, CHAT),
    "CompletionJob": (parse_job, {"model": "m", "prompt": "hi"}),
    "ChatJob": (parse_job, CHAT),
    "ResponsesRequest": (
        lambda b: to_parsed(parse(b, ResponsesRequest), [], "hermes", 1 << 20),
        {"model": "m", "input": "hi"},
    ),
}
SCHEMAS = schema_components()


def _bounded(schema: dict) -> dict | None:
    """The one alternative of a property that a scalar bound applies to."""
    for one in schema.get("anyOf", [schema]):
        if one.get("type") in ("integer", "number", "string") and set(one) & BOUNDS.keys():
            return one
    return None


def _past(value, kind: str, down: bool):
    if kind == "integer":
        return value - 1 if down else value + 1
    return math.nextafter(value, -math.inf if down else math.inf)


# a bound -> (a value at it, a value just past it)
BOUNDS = {
    "minimum": lambda b, k: (b, _past(b, k, True)),
    "maximum": lambda b, k: (b, _past(b, k, False)),
    "exclusiveMinimum": lambda b, k: (_past(b, k, False), b),
    "maxLength": lambda b, k: ("u" * b, "u" * (b + 1)),
    "minLength": lambda b, k: ("u" * b, "u" * (b - 1)),
}
CASES = [
    (body, name, bound, limit)
    for body in PARSERS
    for name, schema in SCHEMAS[body]["properties"].items()
    if (field := _bounded(schema)) is not None
    for bound, limit in field.items()
    if bound in BOUNDS and not (name == "model" or (bound == "minLength" and limit == 0))
]


# what a value at the bound needs beside it (a check across fields: min_tokens <= max_tokens)
COMPANIONS = {"min_tokens": lambda at: {"max_tokens": max(at, 1)}}


def _value(name: str, text: str):
    return "https://example.com/" + text[20:] if name == "on_finish" else text


@pytest.mark.parametrize(("body", "name", "bound", "limit"), CASES)
def test_each_bound_shown_is_the_one_enforced(body, name, bound, limit):
    """The parse and a JSON Schema validator reading the document (an independent
    oracle: ``jsonschema``) agree on the value at the bound and the one past it."""
    parse, base = PARSERS[body]
    kind = _bounded(SCHEMAS[body]["properties"][name])["type"]
    at, past = BOUNDS[bound](limit, kind)
    if kind == "string":
        at, past = _value(name, at), _value(name, past)
    base = {**base, **(COMPANIONS[name](at) if name in COMPANIONS else {})}
    document = _validator(body)
    document.validate({**base, name: at})
    parse({**base, name: at})
    assert not document.is_valid({**base, name: past})
    with pytest.raises(APIError) as refused:
        parse({**base, name: past})
    assert refused.value.status == 400 and refused.value.param == name, refused.value.message
    assert name in refused.value.message


def _validator(body: str) -> jsonschema.Draft202012Validator:
    """The document's schema of ``body``, its references resolved in the document."""
    schema = {"$ref": f"#/components/schemas/{body}", "components": {"schemas": SCHEMAS}}
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_cases_cover_the_bounds_written_elsewhere():
    shown = {(body, name, bound): limit for body, name, bound, limit in CASES}
    assert shown[("CompletionJob", "request_id", "maxLength")] == MAX_REQUEST_ID
    assert shown[("ChatJob", "on_finish", "maxLength")] == MAX_ON_FINISH
    assert shown[("ChatRequest", "user", "maxLength")] == MAX_USER
    assert shown[("CompletionRequest", "presence_penalty", "maximum")] == PENALTY_MAX
    assert shown[("CompletionRequest", "seed", "maximum")] == 2**63 - 1  # vLLM's int64
    assert ("ChatRequest", "top_logprobs", "minimum") in shown
    assert ("CompletionRequest", "top_p", "exclusiveMinimum") in shown
    assert shown[("ResponsesRequest", "user", "maxLength")] == MAX_USER
    assert ("ResponsesRequest", "max_output_tokens", "minimum") in shown
