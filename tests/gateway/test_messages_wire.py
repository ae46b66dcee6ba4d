"""The job record's ``messages`` field at the one validation boundary (no server)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from json_strategies import json_values

from lorapool.lifecycle.submit import build_job
from lorapool.protocol import FieldError
from lorapool.records.job import JobLimits, decode_job, encode_job, job_from_dict

CHAT = [{"role": "user", "content": "hi \x00 there"}]


def test_a_chat_job_round_trips():
    job = build_job({"messages": CHAT}, None, None, "r1", None)
    assert job.prompt is None and job.prompt_token_ids is None
    assert decode_job(encode_job(job)).messages == CHAT


def test_a_job_without_messages_has_no_field_on_the_wire():
    assert b"messages" not in encode_job(build_job("hello", None, None, "r1", None))


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([], "messages must be a non-empty list"),
        ("hi", "messages must be a list"),
        ([{"role": "user"}], "messages[0].content must be a string, got None"),
        ([{"content": "x"}], "messages[0] needs role"),
        ([{"role": "user", "content": "x", "x": 1}], "unknown messages[0] field(s): 'x'"),
        ([{"role": "us\x00er", "content": "x"}], "messages[0].role must be a non-empty string"),
        (
            [{"role": "assistant", "tool_calls": [{"type": "f", "function": {"name": "f"}}]}],
            "messages[0].tool_calls[0].type must be 'function'",
        ),
        ([{"role": "user", "content": "x"}] * 4097, "messages must be a non-empty list of at most"),
        ([{"role": "tool", "content": "x", "tool_call_id": ""}], "messages[0].tool_call_id"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
            "messages[0].tool_calls[0].function.arguments must be a string",
        ),
        ([{"role": "assistant", "tool_calls": {}}], "messages[0].tool_calls must be a list"),
        ([{"role": "user", "content": 1}], "messages[0].content must be a string"),
        ([{"role": "", "content": "x"}], "messages[0].role must be a non-empty string"),
        ([{"role": "x" * 65, "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "\ud800"}], "messages[0].content is not valid Unicode"),
    ],
)
def test_bad_messages_are_named(messages, says):
    with pytest.raises(FieldError, match=r"^job r1: " + re.escape(says)) as refused:
        job_from_dict({"request_id": "r1", "messages": messages})
    # the field's path, for callers that name their own parameter (the OpenAI routes)
    assert refused.value.field is not None and refused.value.field.startswith("messages")


def test_messages_and_a_prompt_are_refused():
    with pytest.raises(FieldError, match="either messages or a prompt"):
        job_from_dict({"request_id": "r1", "messages": CHAT, "prompt": "x"})


def test_messages_count_against_the_prompt_limit():
    big = [{"role": "user", "content": "x" * 100}]
    with pytest.raises(FieldError, match="over the limit of 50"):
        job_from_dict({"request_id": "r1", "messages": big}, JobLimits(max_prompt_bytes=50))


MESSAGE_LIKE = st.lists(
    st.fixed_dictionaries({"role": st.text(max_size=70), "content": json_values()}), max_size=4
)


@given(st.one_of(json_values(), MESSAGE_LIKE))
def test_any_json_messages_is_a_job_or_a_field_error(value):
    try:
        job = job_from_dict({"request_id": "r1", "messages": value})
    except FieldError:
        return
    assert decode_job(encode_job(job)).messages == job.messages
