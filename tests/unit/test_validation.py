"""The one validation boundary (``wire.job_from_dict``), from the producer and from the wire.

Every poison job of issue 14 point 1 is a named case: the error is a
FieldError (a ValueError) that names the field and the value, at submit and
at decode alike. A property test throws arbitrary JSON at the boundary: it
either returns a Job that survives its own round trip or raises FieldError /
ValueError, never anything else.
"""

from __future__ import annotations

import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from json_strategies import json_values as any_json

from lorapool.lifecycle.submit import build_job
from lorapool.lifecycle.wire import JobLimits, decode_job, encode_job, job_from_dict
from lorapool.protocol import FieldError, LoRARequest, SamplingParams

VALID = {
    "v": 1,
    "request_id": "r1",
    "prompt": "hello",
    "prompt_token_ids": None,
    "sampling_params": {"max_tokens": 4, "temperature": 0.0},
    "lora_request": None,
    "metadata": {"user": "u"},
    "arrival_time": 1.0,
}


def _with(**changes) -> bytes:
    """VALID with top-level or sampling_params (``sp_`` prefix) fields replaced, as raw JSON."""
    data = {**VALID, "sampling_params": dict(VALID["sampling_params"])}
    for key, value in changes.items():
        if key.startswith("sp_"):
            data["sampling_params"][key[3:]] = value
        else:
            data[key] = value
    return orjson.dumps(data)


# (SamplingParams keyword, bad value, what the message must say)
PARAM_CASES = {
    "seed_string": ("seed", "abc", "sampling_params.seed must be an integer, got 'abc'"),
    "top_k_float": ("top_k", 2.5, "sampling_params.top_k must be an integer, got 2.5"),
    "logprobs_float": ("logprobs", 2.5, "sampling_params.logprobs must be an integer, got 2.5"),
    "stop_not_strings": ("stop", [1], r"sampling_params.stop\[0\] must be a non-empty string"),
    "stop_token_ids_strings": (
        "stop_token_ids",
        ["a"],
        r"sampling_params.stop_token_ids\[0\] must be an integer, got 'a'",
    ),
    "seed_too_big": ("seed", 2**70, "sampling_params.seed must be in"),
    "temperature_nan": (
        "temperature",
        math.nan,
        "sampling_params.temperature must be a finite number",
    ),
    "top_p_inf": ("top_p", math.inf, "sampling_params.top_p must be a finite number"),
    "n_bool": ("n", True, "sampling_params.n must be an integer, got True"),
    "max_tokens_string": (
        "max_tokens",
        "16",
        "sampling_params.max_tokens must be an integer, got '16'",
    ),
    "ignore_eos_int": ("ignore_eos", 1, "sampling_params.ignore_eos must be true or false, got 1"),
    "output_kind_unknown": ("output_kind", "all", "sampling_params.output_kind must be one of"),
}


NOT_JSON = {"temperature_nan", "top_p_inf"}  # JSON has no NaN or Inf


@pytest.mark.parametrize("case", sorted(PARAM_CASES))
def test_bad_sampling_params_are_refused_at_construction_and_at_submit(case):
    name, value, message = PARAM_CASES[case]
    with pytest.raises(FieldError, match=message):
        SamplingParams(**{name: value})
    params = SamplingParams()
    setattr(params, name, value)  # changed after construction: submit checks again
    with pytest.raises(FieldError, match=message):
        build_job("p", params, None, None, None)


@pytest.mark.parametrize("case", sorted(set(PARAM_CASES) - NOT_JSON))
def test_bad_sampling_params_are_refused_on_the_wire(case):
    name, value, message = PARAM_CASES[case]
    if name == "seed" and value == 2**70:
        value = float(value)  # what orjson makes of it: the raw XADD
        message = "sampling_params.seed must be an integer"
    with pytest.raises(FieldError, match=f"job r1: {message}"):
        decode_job(_with(**{f"sp_{name}": value}))


JOB_CASES = {
    "arrival_time_list": ({"arrival_time": [1]}, "arrival_time must be a finite number"),
    "arrival_time_string": ({"arrival_time": "now"}, "arrival_time must be a finite number"),
    "lora_name_list": (
        {"lora_request": {"lora_name": [1], "lora_int_id": 1}},
        "lora_request.lora_name must be a non-empty string",
    ),
    "lora_id_float": (
        {"lora_request": {"lora_name": "a", "lora_int_id": 1.5}},
        "lora_int_id must be an int",
    ),
    "lora_unknown_field": (
        {"lora_request": {"lora_name": "a", "lora_int_id": 1, "rank": 8}},
        "unknown lora_request field",
    ),
    "lora_not_object": ({"lora_request": "a"}, "lora_request must be an object"),
    "metadata_list": ({"metadata": [1]}, "metadata must be an object"),
    "prompt_number": ({"prompt": 5}, "prompt must be a string, got 5"),
    "prompt_ids_negative": ({"prompt_token_ids": [1, -2]}, r"prompt_token_ids\[1\]"),
    "prompt_ids_empty": ({"prompt_token_ids": [], "prompt": None}, "non-empty list"),
    "request_id_braces": ({"request_id": "a{b}"}, "request_id must be"),
    "request_id_nul": ({"request_id": "a\x00b"}, "request_id must be"),
    "request_id_number": ({"request_id": 7}, "request_id must be"),
    "unknown_field": ({"priority": 1}, "unknown job field"),
    "sampling_params_list": ({"sampling_params": [1]}, "sampling_params must be an object"),
    "n_over_max_n": ({"sampling_params": {"n": 129}}, r"n must be at most 128 \(max_n\)"),
}


@pytest.mark.parametrize("case", sorted(JOB_CASES))
def test_bad_jobs_are_refused_on_the_wire_naming_the_field(case):
    changes, message = JOB_CASES[case]
    with pytest.raises(FieldError, match=message):
        decode_job(_with(**changes))


def test_prompt_size_limit_at_submit_and_decode():
    limits = JobLimits(max_prompt_bytes=1000)
    build_job("é" * 500, None, None, None, None, limits)  # 1000 bytes of UTF-8
    with pytest.raises(FieldError, match="1002 bytes, over the limit of 1000"):
        build_job("é" * 501, None, None, None, None, limits)
    with pytest.raises(FieldError, match="over the limit of 1000"):
        build_job({"prompt_token_ids": list(range(251))}, None, None, None, None, limits)
    big = _with(prompt="x" * (1 << 20 + 1))
    with pytest.raises(FieldError, match="over the limit of 1048576"):
        decode_job(big)  # the default, 1 MB


def test_prompt_that_is_not_unicode_text_is_named():
    with pytest.raises(FieldError, match="prompt is not valid Unicode"):
        build_job("a\ud800b", None, None, None, None)


def test_metadata_that_is_not_json_is_named():
    with pytest.raises(FieldError, match="metadata must be JSON"):
        build_job("p", None, None, None, {1: "int key"})
    with pytest.raises(FieldError, match="metadata is"):
        build_job("p", None, None, None, {"x": "y" * 70_000})


def test_lora_request_checked_at_submit():
    lora = LoRARequest("a", 1)
    lora.lora_int_id = "1"
    with pytest.raises(FieldError, match="lora_int_id"):
        build_job("p", None, lora, None, None)


def test_valid_unicode_and_nul_in_prompt_pass():
    job = build_job("a\x00b — 日本 🎉", None, None, None, {"k": "\x00"})
    assert decode_job(encode_job(job)).prompt == "a\x00b — 日本 🎉"


# --- property: arbitrary JSON only ever yields a Job or a ValueError -----------------

json_values = any_json()
param_names = st.sampled_from(sorted(SamplingParams.__dataclass_fields__) + ["bogus"])
job_fields = st.sampled_from(sorted(VALID) + ["extra"])


@st.composite
def mutated_jobs(draw):
    """A valid job with some fields (top-level or sampling params) replaced by any JSON."""
    data = {**VALID, "sampling_params": dict(VALID["sampling_params"])}
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()) and isinstance(data["sampling_params"], dict):
            data["sampling_params"][draw(param_names)] = draw(json_values)
        else:
            data[draw(job_fields)] = draw(json_values)
    return data


@settings(max_examples=400, deadline=None)
@given(st.one_of(json_values, mutated_jobs()))
def test_any_json_gives_a_job_or_a_field_error(data):
    try:
        job = job_from_dict(data)
    except ValueError as exc:
        assert str(exc)
        return
    assert decode_job(encode_job(job)).to_dict() == job.to_dict()
