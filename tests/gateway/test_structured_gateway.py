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
        ({"guided_choice": []}, "guided_choice", "1 to"),
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
