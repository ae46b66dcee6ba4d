"""Structured outputs through the gateway on the tiny random model (a grammar makes even
random weights produce valid output), with the official ``openai`` client: a pool of
the base model and three adapters."""

from __future__ import annotations

import json
import time

import httpx
import openai
import orjson
import pytest
import structured_checks as checks

pytestmark = pytest.mark.integration
ADAPTERS = {
    "ad-qv": ("q_proj", "v_proj"),
    "ad-mlp": ("gate_proj", "up_proj"),
    "ad-o": ("o_proj", "down_proj"),
}


@pytest.fixture(scope="module")
def base(tiny_model_path):
    """The tiny llama with room for the tools' description (~500 tiny-tokenizer tokens)."""
    return tiny_model_path("llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def adapter_dirs(model, tmp_path_factory):
    from adapters import build_adapter

    root = tmp_path_factory.mktemp("structured-adapters")
    return {
        name: build_adapter(model, root / name, rank=8, targets=t, seed=i, std=0.2)
        for i, (name, t) in enumerate(ADAPTERS.items())
    }


def test_parse_returns_a_pet_for_each_of_16_mixed_adapter_requests(client, registry, base_name):
    pets = checks.parse_batch(client, [base_name, *ADAPTERS])
    assert len(pets) == 16


def test_json_schema_strict_on_chat_and_completions_streamed_and_not(client):
    checks.json_schema_everywhere(client, "ad-qv")


def test_guided_choice_and_regex_through_extra_body(client, base_name):
    checks.guided_extras(client, base_name)


@pytest.mark.parametrize(
    "extra, param, problem",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
            "type",
        ),
        ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
        ({"guided_choice": []}, "guided_choice", "non-empty list of at most 1024"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"response_format": {"type": "yaml"}}, "response_format", "'yaml'"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "not several"),
        ({"structured_outputs": {"regex": "a", "unknown": 1}}, "structured_outputs", "unknown"),
    ],
)
def test_an_invalid_constraint_is_a_400_naming_it(client, base_name, extra, param, problem):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=base_name, prompt="x", max_tokens=4, extra_body=extra)
    error = info.value.body
    assert error["param"] == param, error
    assert problem in error["message"], error


def test_a_job_carries_its_constraint_to_the_audit_record(gateway, conn, prefix, base_name):
    body = {
        "model": base_name,
        "messages": checks.ASK,
        "response_format": checks.RESPONSE_FORMAT,
        "max_tokens": checks.MAX_TOKENS,
    }
    created = httpx.post(f"{gateway}/v1/jobs", json=body, timeout=30).json()
    job_id = created["id"]
    result = _wait_job(gateway, job_id)
    checks._valid_json(result["outputs"][0]["text"], result["outputs"][0]["finish_reason"])
    records = [orjson.loads(f[b"data"]) for _, f in conn.xrange(f"{prefix}:audit")]
    [record] = [r for r in records if r["request_id"] == job_id]
    constraint = record["sampling_params"]["structured_outputs"]
    assert json.loads(json.dumps(constraint["json"])) == checks.SCHEMA
    assert constraint["disable_additional_properties"] is True


def _wait_job(gateway: str, job_id: str) -> dict:
    for _ in range(600):
        job = httpx.get(f"{gateway}/v1/jobs/{job_id}", timeout=30).json()
        if job["status"] not in ("queued", "running"):
            assert job["status"] == "finished", job
            return job["result"]
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish")


def test_tool_calls_required_and_named_streamed_and_not(client):
    checks.tool_calls_forced(client, "ad-mlp")


def test_a_tool_result_goes_back_to_the_model(client, base_name):
    checks.tool_conversation(client, base_name)


HERMES = (
    r'<tool_call>\n\{"name":"get_weather","arguments":\{"city":"Paris","unit":"c"\}\}\n</tool_call>'
)
LLAMA3 = r'\{"name":"get_weather","parameters":\{"city":"Paris","unit":"c"\}\}'


@pytest.fixture(scope="module")
def hermes_client(redis_url, prefix, worker, tmp_path_factory):
    """A second gateway of the pool, reading replies with the hermes parser."""
    from gateway_procs import serve, stop

    url, proc = serve(
        redis_url, prefix, tmp_path_factory.mktemp("hermes"), "--tool-call-parser", "hermes"
    )
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    stop(proc)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("family", ["hermes", "llama3_json"])
def test_auto_tool_calls_are_parsed_from_the_text(
    client, hermes_client, base_name, streamed, family
):
    """tool_choice auto: the reply is read by the family's parser (the regex makes the
    random model write a call; hermes: after some content). The tiny model's name says
    llama, so the default gateway reads llama3_json."""
    pattern, content_before = (
        ("Sure[.] " + HERMES, "Sure.") if family == "hermes" else (LLAMA3, None)
    )
    got = (hermes_client if family == "hermes" else client).chat.completions.create(
        model=base_name,
        messages=checks.TOOL_ASK,
        tools=checks.TOOLS,
        max_tokens=200,
        stream=streamed,
        extra_body={"guided_regex": pattern},
    )
    if streamed:
        calls, reason, content = checks._streamed_calls(got)
        [call] = calls.values()
        name, arguments = call["name"], call["arguments"]
        content = content.strip() or None  # streamed: the space before the call came first
    else:
        message, reason = got.choices[0].message, got.choices[0].finish_reason
        content = message.content
        assert message.tool_calls, (reason, content)
        [call] = message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert reason == "tool_calls"
    assert content == content_before
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris", "unit": "c"}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": checks.TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": checks.TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": checks.TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "tools": checks.TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
def test_bad_tool_parameters_are_a_400_naming_them(client, base_name, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=base_name, messages=checks.TOOL_ASK, max_tokens=4, **_split(extra)
        )
    assert info.value.body["param"] == param, info.value.body


def _split(extra: dict) -> dict:
    known = {"tools", "tool_choice", "parallel_tool_calls", "response_format"}
    return {k: v for k, v in extra.items() if k in known}
