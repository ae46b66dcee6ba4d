"""A FieldError carries the path of the field it is about (``.field``), and the OpenAI
errors name the request's parameter from that path, not from the message's words."""

from __future__ import annotations

import orjson
import pytest
from job_changes import changed

from lorapool.openai.errors import field_error
from lorapool.protocol import FieldError, SamplingParams
from lorapool.records.job import decode_job, job_from_dict

JOB = {"v": 1, "request_id": "r9", "prompt": "hi", "sampling_params": {"max_tokens": 4}}


def _job(**changes) -> bytes:
    return orjson.dumps(changed(JOB, **changes))


@pytest.mark.parametrize(
    "changes, path, param",
    [
        ({"sp_logprobs": -1}, "sampling_params.logprobs", "logprobs"),
        ({"sp_stop": ["a", 5]}, "sampling_params.stop[1]", "stop"),
        ({"sp_logit_bias": {"7": 300}}, "sampling_params.logit_bias[7]", "logit_bias"),
        ({"prompt_token_ids": [1, -3]}, "prompt_token_ids[1]", "prompt"),
        ({"sp_bogus": 1}, "sampling_params", None),  # no one parameter
        ({"lora_request": {"lora_name": "", "lora_int_id": 1}}, "lora_request.lora_name", None),
    ],
)
def test_the_parameter_is_named_by_the_errors_path(changes, path, param):
    with pytest.raises(FieldError) as info:
        decode_job(_job(**changes))
    assert info.value.field == path and info.value.request_id == "r9"
    error = field_error(info.value, "r9")
    assert (error.status, error.param) == (400, param)
    assert not str(error.message).startswith("job r9")


def test_a_request_parameter_that_set_a_job_field_is_named_as_the_request_has_it():
    """Chat's top_logprobs sets the job's logprobs: the error names top_logprobs, in the
    parameter and at the start of its message."""
    with pytest.raises(FieldError) as info:
        job_from_dict(orjson.loads(_job(sp_logprobs=2.5)))
    error = field_error(info.value, "r9", {"logprobs": "top_logprobs"})
    assert error.param == "top_logprobs"
    assert error.message.startswith("top_logprobs must be an integer, got 2.5")


def test_a_python_built_record_names_the_same_path():
    with pytest.raises(FieldError) as info:
        SamplingParams(seed=2**65)
    assert info.value.field == "sampling_params.seed"
    with pytest.raises(FieldError) as info:
        SamplingParams(top_k=0)
    assert info.value.field == "sampling_params.top_k"
    assert field_error(info.value).param == "top_k"


def test_an_error_without_a_path_is_still_read_from_its_words():
    """Checks that raise a FieldError without a path (the chat messages') keep the
    message rule: the field the message opens with."""
    error = field_error(FieldError("messages[0].role must be a non-empty string"))
    assert error.param == "messages"
    assert field_error(FieldError("the job needs a non-empty prompt")).param == "prompt"
