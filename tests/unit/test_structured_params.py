"""Structured outputs and logit_bias at the job boundary: shapes, bounds, the wire."""

from __future__ import annotations

import json
import math

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lorapool.protocol import FieldError, SamplingParams
from lorapool.records.job import decode_job, encode_job, job_from_dict
from lorapool.records.structured import MAX_CONSTRAINT_BYTES, StructuredOutputsParams, check_grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_constraint_travels_on_the_wire_and_back():
    params = SamplingParams(
        structured_outputs={"json": SCHEMA, "disable_additional_properties": True},
        logit_bias={"7": 2.5, 9: -100},
    )
    job = job_from_dict({"request_id": "r", "prompt": "x", "sampling_params": params.to_dict()})
    back = decode_job(encode_job(job)).sampling_params
    assert back.structured_outputs == params.structured_outputs
    assert back.structured_outputs.json == SCHEMA
    assert back.logit_bias == {7: 2.5, 9: -100.0}
    assert orjson.loads(orjson.dumps(back.to_dict()))["logit_bias"] == {"7": 2.5, "9": -100.0}


@pytest.mark.parametrize(
    "value, problem",
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"choice": []}, "choice must be a non-empty list of at most 1024"),
        ({"choice": ["a", 3]}, r"choice\[1\] must be a non-empty string, got 3"),
        ({"json": "{nope"}, "not valid JSON"),
        ({"json": [1]}, "json must be an object or a string"),
        ({"json": "[1]"}, "json must be a JSON schema"),
        ({"json_object": "yes"}, "json_object must be true or false"),
        ({"json_object": False}, "exactly one of"),
        ({"regex": ""}, "non-empty string"),
        ({"grammar": 3}, "non-empty string"),
        ({"regex": "a", "whitespace_pattern": 1}, "whitespace_pattern"),
        ({"regex": "a", "bogus": 1}, "unknown sampling_params.structured_outputs field"),
        ({"regex": "a" * (MAX_CONSTRAINT_BYTES + 1)}, "over the limit"),
        ("json", "must be an object"),
    ],
)
def test_a_malformed_constraint_is_named(value, problem):
    with pytest.raises(FieldError, match=problem):
        SamplingParams(structured_outputs=value)


@pytest.mark.parametrize(
    "bias, problem",
    [
        (
            {"x": 1},
            r"logit_bias keys must be a token id \(an integer in \[0, 2147483647\]\), got 'x'",
        ),
        ({"-1": 1}, "logit_bias keys must be a token id"),
        ({"1": math.nan}, r"logit_bias\[1\] must be a finite number"),
        ({"1": 101}, r"logit_bias\[1\] must be a finite number in \[-100.0, 100.0\], got 101"),
        ({"1": "2"}, "finite number"),
        ([1], "must be an object"),
        ({str(i): 0 for i in range(1025)}, "at most 1024"),
    ],
)
def test_a_bad_logit_bias_is_named(bias, problem):
    with pytest.raises(FieldError, match=problem):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize(
    "params, problem",
    [
        (StructuredOutputsParams(json={"type": "objectx"}), "objectx"),
        (StructuredOutputsParams(regex="(("), "unclosed group"),
        (StructuredOutputsParams(grammar="start: nowhere"), "nowhere"),
        (StructuredOutputsParams(grammar="root ::= ("), "grammar"),
    ],
)
def test_check_grammar_names_what_does_not_compile(params, problem):
    with pytest.raises(FieldError, match=problem):
        check_grammar(params)


def test_every_kind_compiles():
    for params in (
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex="[0-9]+"),
        StructuredOutputsParams(choice=['say "hi"', "a\\b", "日本"]),
        StructuredOutputsParams(grammar='start: "a"+'),
        StructuredOutputsParams(grammar='root ::= "a" [b-c]*'),
        StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?"),
    ):
        assert check_grammar(params)


def test_a_batch_line_carries_its_constraint_and_tools_into_its_job():
    """Batch lines go through the gateway's own parser: a line's response_format, guided_*
    and tools reach the job as they do over HTTP; a bad schema names the line's field
    (compiled by the validator's sandbox, as the gateway compiles a request's)."""
    from lorapool.batch.lines import LineError, check_line_grammar, parse_line
    from lorapool.grammar_sandbox import GrammarSandbox
    from lorapool.records.job import JobLimits

    body = {"model": "m", "prompt": "x", "guided_json": SCHEMA}
    record = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}
    line = parse_line(1, orjson.dumps(record), "batch_1", JobLimits())
    assert line.parsed.params.structured_outputs.json == SCHEMA
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }
    record = {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": chat}
    line = parse_line(2, orjson.dumps(record), "batch_1", JobLimits())
    assert line.parsed.params.structured_outputs.json == SCHEMA
    assert line.parsed.prompts[0]["tools"] == [tool]
    bad = {**body, "guided_json": {"type": "nope"}}
    record = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": bad}
    line = parse_line(3, orjson.dumps(record), "batch_1", JobLimits())
    sandbox = GrammarSandbox()
    try:
        with pytest.raises(LineError) as info:
            check_line_grammar(line, sandbox)
    finally:
        sandbox.close()
    assert info.value.field == "body.guided_json" and "nope" in str(info.value)


# what a decoded schema can hold: every kind of JSON value, any text (astral too)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False,
    allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)  # fmt: skip


@given(st.dictionaries(st.text(), JSON_VALUES, min_size=1, max_size=4))
def test_a_schemas_spec_is_at_most_three_times_its_compact_encoding(schema):
    """What lets ``verify`` skip writing a schema within a third of the limit: the spec
    (``json.dumps``, audited and measured) is never more than 3x orjson's compact UTF-8."""
    spec = StructuredOutputsParams(json=schema).spec.encode("utf-8", "surrogatepass")
    assert len(orjson.dumps(schema)) <= len(spec) <= 3 * len(orjson.dumps(schema))


@pytest.mark.parametrize("char", ["é", "中", "😀", "\n", "a"])
def test_a_schema_over_the_limit_as_written_is_refused_whatever_its_compact_size(char):
    """Escaped, a character takes up to 12 bytes: one count under the limit compact,
    and over it as the spec is written, is still refused; one a third of it passes."""
    per = len(json.dumps(char)) - 2
    over = {"description": char * (MAX_CONSTRAINT_BYTES // per + 1)}
    with pytest.raises(FieldError, match=f"is {len(json.dumps(over, sort_keys=True))} bytes"):
        StructuredOutputsParams(json=over)
    within = {"d": char * (MAX_CONSTRAINT_BYTES // 3 // len(char.encode()) - 20)}
    assert StructuredOutputsParams(json=within).json == within
