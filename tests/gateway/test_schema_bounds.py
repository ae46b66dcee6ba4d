"""The request bodies' OpenAPI description shows the bounds the checks enforce.

``gateway/schemas.py`` is documentation; these tests hold each bound it shows to the check
that enforces it: a value at the shown bound passes the check, one just past it is refused.
"""

import pytest

from lorapool.gateway.schemas import ChatRequest, CompletionRequest, JobRequest
from lorapool.lifecycle.submit import check_on_finish
from lorapool.lifecycle.wire import MAX_REQUEST_ID
from lorapool.openai.errors import APIError
from lorapool.openai.params import MAX_USER, parse_completion
from lorapool.protocol import FieldError, SamplingParams


def _field(model, name: str) -> dict:
    schema = model.model_json_schema()["properties"][name]
    return next((s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"), schema)


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty", "seed"])
@pytest.mark.parametrize("model", [CompletionRequest, ChatRequest, JobRequest])
def test_sampling_bounds_are_the_checks(model, name):
    field = _field(model, name)
    lo, hi = field["minimum"], field["maximum"]
    SamplingParams(**{name: lo})
    SamplingParams(**{name: hi})
    step = 1 if name == "seed" else 1e-6
    for past in (lo - step, hi + step):
        with pytest.raises(FieldError, match=name):
            SamplingParams(**{name: past})


def test_length_bounds_are_the_checks():
    assert _field(JobRequest, "request_id")["maxLength"] == MAX_REQUEST_ID
    assert _field(CompletionRequest, "user")["maxLength"] == MAX_USER
    body = {"model": "m", "prompt": "hi"}
    parse_completion({**body, "user": "u" * MAX_USER}, 1)
    with pytest.raises(APIError, match="user"):
        parse_completion({**body, "user": "u" * (MAX_USER + 1)}, 1)
    longest = _field(JobRequest, "on_finish")["maxLength"]
    url = "https://example.com/"
    check_on_finish(url + "a" * (longest - len(url)))
    with pytest.raises(FieldError, match="on_finish"):
        check_on_finish(url + "a" * (longest - len(url) + 1))
