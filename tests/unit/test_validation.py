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
from job_changes import changed
from json_strategies import json_values as any_json

from lorapool.lifecycle.submit import build_job
from lorapool.protocol import FieldError, LoRARequest, SamplingParams
from lorapool.records.job import JobLimits, decode_job, encode_job, job_from_dict

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
    return orjson.dumps(changed(VALID, **changes))


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


@pytest.mark.parametrize(
    "prompt, ids, size",
    [
        ("x" * 1000, None, 1000),  # ASCII: its length
        ("é" * 500, None, 1000),  # 2 bytes a character
        ("日" * 333 + "x", None, 1000),  # 3
        ("🎉" * 250, None, 1000),  # 4
        ("🎉" * 200 + "x" * 196, [1], 1000),  # characters a quarter of the limit or less
        ("é" * 249, [1], 502),
    ],
)
def test_the_prompt_size_is_its_utf8_bytes_on_the_wire_as_at_submit(prompt, ids, size):
    """A worker counts a decoded prompt without encoding a copy where its characters
    cannot pass the limit however wide; the oracle: Python's UTF-8 encoder."""
    assert len(prompt.encode()) + 4 * len(ids or ()) == size
    fits = JobLimits(max_prompt_bytes=size)
    over = JobLimits(max_prompt_bytes=size - 1)
    job = {"prompt": prompt} if ids is None else {"prompt": prompt, "prompt_token_ids": ids}
    payload = _with(**job, request_id="r1")
    assert decode_job(payload, fits).prompt == prompt
    widest = 4 * len(prompt) + 4 * len(ids or ())  # the shortcut's edge: passes uncounted
    assert decode_job(payload, JobLimits(max_prompt_bytes=widest)).prompt == prompt
    job_from_dict(orjson.loads(payload), fits)
    for check in (
        lambda: decode_job(payload, over),
        lambda: job_from_dict(orjson.loads(payload), over),
    ):
        with pytest.raises(
            FieldError, match=f"the prompt is {size} bytes, over the limit of {size - 1}"
        ):
            check()


def test_prompt_that_is_not_unicode_text_is_named():
    with pytest.raises(FieldError, match="prompt is not valid Unicode"):
        build_job("a\ud800b", None, None, None, None)


def test_metadata_that_is_not_json_is_named():
    with pytest.raises(FieldError, match="metadata keys must be a string, got 1"):
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
param_names = st.sampled_from(sorted(SamplingParams.__struct_fields__) + ["bogus"])
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


# --- property: a Python-built SamplingParams or LoRARequest is checked as the wire is ---

python_values = (
    any_json()
    | st.floats()  # NaN and infinities: Python has them, JSON does not
    | st.integers(min_value=-(2**80), max_value=2**80)  # past 64 bits
    | st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from("\x00{}"), max_size=8)
    | st.tuples(st.integers(0, 5))
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(SamplingParams.__struct_fields__)), python_values)
def test_any_python_value_gives_params_the_wire_keeps_or_a_field_error_naming_it(name, value):
    """Either the params are built, and a job of them decodes to the same params (the
    worker's msgspec check accepts what the Python check did), or FieldError whose
    ``field`` path names the field, as its message does."""
    try:
        params = SamplingParams(**{name: value})
    except FieldError as exc:
        assert exc.field is not None and exc.field.startswith(f"sampling_params.{name}")
        assert name in str(exc)
        return
    limits = JobLimits(max_n=2**80)  # n's bound is the deployment's, not the record's
    job = build_job("p", params, None, "r", None, limits)
    assert decode_job(encode_job(job), limits).sampling_params.to_dict() == params.to_dict()


@pytest.mark.parametrize("name", ["temperature", "top_p", "repetition_penalty"])
def test_an_int_for_a_float_field_is_the_float_the_wire_carries(name):
    """2**53 + 1 has no float: the params hold the float the job decodes to (Hypothesis
    found the params holding the int, which the wire then rounded)."""
    value = 2**53 + 1 if name == "temperature" else 1
    params = SamplingParams(**{name: value})
    assert isinstance(getattr(params, name), float) and getattr(params, name) == float(value)
    job = build_job("p", params, None, "r", None)
    assert decode_job(encode_job(job)).sampling_params.to_dict() == params.to_dict()


@settings(max_examples=200, deadline=None)
@given(python_values, python_values)
def test_any_python_lora_request_is_built_or_names_its_field(name, adapter_id):
    try:
        lora = LoRARequest(name, adapter_id, "/p")
    except FieldError as exc:
        assert exc.field in ("lora_request.lora_name", "lora_request.lora_int_id")
        assert str(exc).startswith(exc.field)
        return
    job = build_job("p", None, lora, "r", None)
    back = decode_job(encode_job(job)).lora_request
    assert (back.lora_name, back.lora_int_id) == (name, adapter_id)


@pytest.mark.parametrize(
    "changes, field, message",
    [
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids[1]", "must be a token id"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids[1]", "must be an integer, got True"),
        ({"sp_seed": 7}, "sampling_params.seed", "must be in"),  # made 2**64 below
        ({"sp_n": True}, "sampling_params.n", "must be an integer, got True"),
        ({"sp_stop": ["a", ""]}, "sampling_params.stop[1]", "must be a non-empty string"),
        ({"sp_logit_bias": {"3": 1e9}}, "sampling_params.logit_bias[3]", "got 1000000000.0"),
        ({"request_id": "x" * 257}, "request_id", "at most 256 characters"),
        ({"result_ttl_s": 0}, "result_ttl_s", "must be an integer in [1, 31622400]"),
        ({"arrival_time": -1}, "arrival_time", "must be a finite number >= 0.0, got -1"),
        ({"lora_request": {"lora_name": "a"}}, "lora_request", "needs lora_int_id"),
        ({"sp_bogus": 1}, "sampling_params", "unknown sampling_params field(s): 'bogus'"),
        ({"request_id": "日本\x00"}, "request_id", "without braces or NUL, got '日本\\x00'"),
        ({"prompt": None}, "prompt", "needs a non-empty prompt"),
    ],
)
def test_a_refused_job_names_the_field_by_path(changes, field, message):
    payload = _with(**changes).replace(b'"seed":7', b'"seed":%d' % 2**64)  # orjson's limit
    with pytest.raises(FieldError) as info:
        decode_job(payload)
    assert info.value.field == field
    assert str(info.value).startswith("job r1: ") or field == "request_id"
    assert message in str(info.value)
