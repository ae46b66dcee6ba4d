"""Hostile request bodies sent raw: each gets a 400 (or 413) in OpenAI's error shape
naming the parameter, nothing reaches a worker, and the pool keeps serving."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_strategies import json_values

pytestmark = pytest.mark.integration
BASE = {"model": "ad-qv", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "ad-qv", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

COMPLETION_CASES = [
    ({"prompt": 5}, "prompt"),
    ({"prompt": [[1, 2], "x", 3.5]}, "prompt"),
    ({"prompt": [-1, 2]}, "prompt"),
    ({"prompt": [2**40]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"stop": [1]}, "stop"),
    ({"stop": "\x00" * 0}, "stop"),
    ({"seed": 2**70}, "seed"),
    ({"n": 10**6}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": 1}}, "stream_options"),
    ({"user": 7}, "user"),
    ({"model": 3}, "model"),
    ({"model": "ad\x00qv"}, "model"),
    ({"model": ""}, "model"),
    ({"top_logprobs": 1}, "top_logprobs"),  # a chat's: refused, not dropped
    ({"suffix": "x"}, "suffix"),
    ({"modalities": ["audio"]}, "modalities"),
]
CHAT_CASES = [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": 5, "content": "x"}]}, "messages"),
    ({"messages": [{"role": "us\x00er", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
]


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize(("change", "param"), COMPLETION_CASES)
def test_completion_field_is_named(gateway, change, param):
    body = {**BASE, **change}
    if change.get("stop") == "":
        body["stop"] = [""]
    error = _error(httpx.post(f"{gateway}/v1/completions", json=body, timeout=30))
    assert error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("change", "param"), CHAT_CASES)
def test_chat_field_is_named(gateway, change, param):
    error = _error(httpx.post(f"{gateway}/v1/chat/completions", json={**CHAT, **change}))
    assert error["param"].startswith(param), error


def test_not_json_and_not_an_object(gateway):
    raw = httpx.post(f"{gateway}/v1/completions", content=b"\x00{", timeout=30)
    assert "not valid JSON" in _error(raw)["message"]
    assert _error(httpx.post(f"{gateway}/v1/completions", json=[1, 2]))["param"] is None
    for route in ("completions", "chat/completions", "jobs"):  # invalid UTF-8 in a string
        raw = httpx.post(f"{gateway}/v1/{route}", content=b'{"model": "\xff", "prompt": "x"}')
        assert raw.status_code == 400 and "not valid JSON" in _error(raw)["message"], route


@pytest.mark.parametrize("number", [b"1e400", b"-1e400", b"NaN", b"1" * 5000])
def test_overflowing_numbers(gateway, number):
    body = b'{"model": "ad-qv", "prompt": "x", "temperature": ' + number + b"}"
    response = httpx.post(f"{gateway}/v1/completions", content=body, timeout=30)
    assert response.status_code == 400, response.text


def test_oversized_prompt_and_body(gateway):
    big = {**BASE, "prompt": "x" * ((1 << 20) + 1)}
    assert _error(httpx.post(f"{gateway}/v1/completions", json=big), 413)["param"] == "prompt"
    huge = b'{"prompt": "' + b"y" * (8 << 20) + b'"}'
    assert _error(httpx.post(f"{gateway}/v1/completions", content=huge), 413)


def test_nul_bytes_in_text_are_text(gateway, client):
    """NUL is a character like any other in a prompt or a stop string: served."""
    body = {**BASE, "prompt": "a\x00b", "stop": ["\x00"], "temperature": 0}
    response = httpx.post(f"{gateway}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_the_pool_serves_after_all_that(client, worker):
    done = client.completions.create(model="ad-qv", prompt="still there?", max_tokens=3)
    assert done.usage.completion_tokens >= 1
    assert worker.poll() is None


FIELDS = sorted(
    {"prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed"}
    | {"presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "user"}
    | {"stream", "stream_options", "stop_token_ids", "ignore_eos", "min_tokens", "echo"}
    | {"suffix", "logit_bias", "model", "nonsense", "messages", "top_logprobs"}
    | {"max_completion_tokens", "request_id"}
)
ENDPOINTS = [("/v1/completions", BASE), ("/v1/chat/completions", CHAT), ("/v1/jobs", BASE)]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    endpoint=st.sampled_from(ENDPOINTS),
    name=st.sampled_from(FIELDS),
    value=json_values(),
)
def test_any_json_in_any_field_is_answered_never_a_500(gateway, endpoint, name, value):
    """Arbitrary JSON in one field: served (200 or 202), or refused in OpenAI's shape
    with the field named; never a server error."""
    path, base = endpoint
    body = {**base, "temperature": 0, name: value}
    response = httpx.post(f"{gateway}{path}", json=body, timeout=120)
    assert response.status_code in (200, 202, 400, 404, 413), response.text
    if response.status_code not in (200, 202):
        error = response.json()["error"]
        assert error["message"] and error["type"]
        named = (name, None, "prompt") if name == "messages" and "prompt" in base else (name, None)
        assert response.status_code == 404 or error["param"] in named, error


def test_the_pool_still_serves_after_the_fuzz(client, worker):
    done = client.completions.create(model="ad-qv", prompt="and now?", max_tokens=3)
    assert done.usage.completion_tokens >= 1 and worker.poll() is None
