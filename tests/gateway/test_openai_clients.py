"""What OpenAI's clients and SDKs send, with the official ``openai`` client against a real
pool (the tiny random model, a worker process, ``lorapool serve``): the fields they send
by default, legacy ``functions``, ``models.retrieve`` and the Responses API. The oracle
is the engine's ``LLM.chat`` in this process with the same adapter, and for tool turns the
chat route with the same messages."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from lorapool.protocol import SamplingParams
from lorapool.records.adapter import lora_from_record

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
ASK = "Where does the lazy dog sleep?"
SYSTEM = "You answer briefly."
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
        "maximum": 14}}, "required": ["zone"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def base(tiny_model_path):
    """The tiny llama with room for a tool's description in its context."""
    return tiny_model_path("llama", max_position_embeddings=2048)


def _want(llm, registry, messages, adapter="ad-qv"):
    [want] = llm.chat(messages, GREEDY, lora_request=lora_from_record(registry[adapter]))
    return want


def _status(want) -> str:
    return "incomplete" if want.outputs[0].finish_reason == "length" else "completed"


# -- models.retrieve ---------------------------------------------------------------------


def test_models_retrieve_gives_each_models_card(client, registry, base_name):
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    for name in (base_name, *registry):
        assert client.models.retrieve(name).model_dump() == listed[name]
    assert client.models.retrieve("ad-mlp").model_dump()["adapter_id"] == registry["ad-mlp"].id
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["param"] == "model"


# -- the fields clients send -------------------------------------------------------------

DEFAULT_FIELDS = {
    "store": False, "metadata": {"app": "test"}, "service_tier": "auto",
    "reasoning_effort": "low", "prompt_cache_key": "k-1", "safety_identifier": "u-1",
    "verbosity": "low", "modalities": ["text"],
}  # fmt: skip


@pytest.mark.parametrize("field", [*DEFAULT_FIELDS, "unheard_of"])
def test_a_field_clients_send_is_accepted_and_named_as_ignored(client, llm, registry, field):
    value = DEFAULT_FIELDS.get(field, 1)
    known = field in DEFAULT_FIELDS
    kwargs = {field: value} if known else {"extra_body": {field: value}}
    messages = [{"role": "user", "content": ASK}]
    raw = client.chat.completions.with_raw_response.create(
        model="ad-qv", messages=messages, temperature=0.0, max_tokens=12, **kwargs
    )
    assert raw.headers["x-lorapool-ignored-params"] == field
    got = raw.parse()
    assert got.choices[0].message.content == _want(llm, registry, messages).outputs[0].text


REFUSED = [
    ({"modalities": ["text", "audio"]}, "modalities", "modalities[1] must be one of 'text'"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio is not supported"),
    ({"extra_body": {"max_output_tokens": 3}}, "max_output_tokens", "unknown parameter"),
]  # the last: a parameter of another route (the Responses API's), not dropped


def test_what_would_change_the_output_is_refused_naming_it(client):
    for kwargs, param, says in REFUSED:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="ad-qv", messages=[{"role": "user", "content": ASK}], **kwargs
            )
        assert caught.value.body["param"] == param
        assert says in caught.value.body["message"]


def test_legacy_functions_reply_with_a_function_call(client):
    function = {"name": "get_time", "parameters": TIME}
    ask = [{"role": "user", "content": "What time is it?"}]
    got = client.chat.completions.create(
        model="ad-qv", messages=ask, functions=[function], function_call={"name": "get_time"},
        max_tokens=40,
    )  # fmt: skip
    message = got.choices[0].message
    assert message.tool_calls is None and message.content is None
    assert message.function_call.name == "get_time"
    jsonschema.validate(json.loads(message.function_call.arguments), TIME)
    stream = client.chat.completions.create(
        model="ad-qv", messages=ask, functions=[function], function_call={"name": "get_time"},
        max_tokens=40, stream=True,
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in stream if c.choices]
    names = [d.function_call.name for d in deltas if d.function_call and d.function_call.name]
    arguments = "".join(d.function_call.arguments or "" for d in deltas if d.function_call)
    assert names == ["get_time"] and json.loads(arguments) == json.loads(
        message.function_call.arguments
    )
    # the legacy turn sent back: the result reaches the model as a tool message
    back = [*ask, message.model_dump(exclude_none=True),
            {"role": "function", "name": "get_time", "content": "12:00"}]  # fmt: skip
    answer = client.chat.completions.create(
        model="ad-qv", messages=back, functions=[function], function_call="none", max_tokens=8,
        temperature=0.0,
    )  # fmt: skip
    call = message.function_call
    calls = [{"id": "call_get_time", "type": "function",
              "function": {"name": call.name, "arguments": call.arguments}}]  # fmt: skip
    result = {
        "role": "tool",
        "tool_call_id": "call_get_time",
        "name": "get_time",
        "content": "12:00",
    }
    same = [*ask, {"role": "assistant", "tool_calls": calls}, result]
    want = client.chat.completions.create(
        model="ad-qv", messages=same, tools=[{"type": "function", "function": function}],
        tool_choice="none", max_tokens=8, temperature=0.0,
    )  # fmt: skip
    assert answer.choices[0].message.content == want.choices[0].message.content


# -- the Responses API -------------------------------------------------------------------


def test_responses_create_equals_llm_chat(client, llm, registry):
    want = _want(llm, registry, [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": ASK}])  # fmt: skip
    got = client.responses.create(
        model="ad-qv", instructions=SYSTEM, input=ASK, temperature=0.0, max_output_tokens=12
    )
    assert got.id.startswith("resp_") and got.object == "response" and got.model == "ad-qv"
    assert got.output_text == want.outputs[0].text
    assert got.status == _status(want)
    assert got.output[0].type == "message" and got.output[0].role == "assistant"
    assert got.usage.input_tokens == len(want.prompt_token_ids)
    assert got.usage.output_tokens == len(want.outputs[0].token_ids)
    assert got.usage.total_tokens == got.usage.input_tokens + got.usage.output_tokens
    assert got.instructions == SYSTEM and got.max_output_tokens == 12


def test_responses_stream_events_in_openais_order(client, llm, registry):
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    want = _want(llm, registry, [{"role": "user", "content": ASK}], "ad-mlp")
    events = list(client.responses.create(model="ad-mlp", input=items, temperature=0.0,
                                          max_output_tokens=12, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = "response.incomplete" if _status(want) == "incomplete" else "response.completed"
    text = want.outputs[0].text
    middle = ["response.output_item.added", "response.content_part.added"]
    middle += ["response.output_text.delta"] * (kinds.count("response.output_text.delta"))
    middle += ["response.output_text.done", "response.content_part.done",
               "response.output_item.done"]  # fmt: skip
    assert kinds == ["response.created", "response.in_progress", *(middle if text else []),
                     final]  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == len(want.outputs[0].token_ids)
    # the SDK's own accumulator follows the events (it raises on any out of order)
    with client.responses.stream(
        model="ad-mlp", input=items, temperature=0.0, max_output_tokens=12
    ) as stream:
        last = list(stream)[-1]
    assert last.type == final and last.response.output_text == text


class Time(BaseModel):
    zone: int = Field(ge=-12, le=14)
    label: Literal["utc", "local"]


def test_responses_structured_output(client):
    got = client.responses.parse(
        model="ad-qv", input="What time is it?", text_format=Time, max_output_tokens=40
    )
    assert isinstance(got.output_parsed, Time), got.output_text
    schema = {"type": "json_schema", "name": "time", "schema": TIME, "strict": True}
    got = client.responses.create(model="ad-qv", input="Time?", text={"format": schema},
                                  max_output_tokens=40)  # fmt: skip
    jsonschema.validate(json.loads(got.output_text), TIME)
    assert got.text.format.type == "json_schema"


def test_responses_function_tool_round_trip(client):
    tool = {"type": "function", "name": "get_time", "parameters": TIME, "strict": True}
    first = client.responses.create(
        model="ad-qv", input="What time is it?", tools=[tool],
        tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=40,
    )  # fmt: skip
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_time" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TIME)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
    answer = client.responses.create(
        model="ad-qv", previous_response_id=first.id, input=[result], tools=[tool],
        tool_choice="none", temperature=0.0, max_output_tokens=8,
    )  # fmt: skip
    assert answer.previous_response_id == first.id
    chat = [{"role": "user", "content": "What time is it?"},
            {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
             "function": {"name": "get_time", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}]  # fmt: skip
    want = client.chat.completions.create(
        model="ad-qv", messages=chat, temperature=0.0, max_tokens=8, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                                 "strict": True}}],
    )  # fmt: skip
    assert answer.output_text == want.choices[0].message.content
    # the same turn streamed: the call comes as a function_call item with its arguments
    events = list(client.responses.create(
        model="ad-qv", input="What time is it?", tools=[tool], stream=True,
        tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=40,
    ))  # fmt: skip
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"]
    streamed = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == streamed and done.name == "get_time"
    jsonschema.validate(json.loads(streamed), TIME)


def test_previous_response_id_continues_the_stored_conversation(client, llm, registry, gateway):
    first = client.responses.create(model="ad-qv", input=ASK, instructions=SYSTEM,
                                    temperature=0.0, max_output_tokens=12)  # fmt: skip
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(model="ad-qv", previous_response_id=first.id,
                                     input="And the cat?", temperature=0.0,
                                     max_output_tokens=12)  # fmt: skip
    # the instructions are not carried on (OpenAI's); the first reply is the assistant's turn
    conversation = [{"role": "user", "content": ASK},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And the cat?"}]  # fmt: skip
    assert second.output_text == _want(llm, registry, conversation).outputs[0].text
    # streamed responses are stored too
    events = list(client.responses.create(model="ad-qv", input=ASK, stream=True,
                                          max_output_tokens=4))  # fmt: skip
    stored = client.responses.retrieve(events[-1].response.id)
    assert stored.output_text == events[-1].response.output_text
    unstored = client.responses.create(model="ad-qv", input=ASK, store=False, max_output_tokens=2)
    for missing in (unstored.id, "resp_0000"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(missing)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="ad-qv", previous_response_id=unstored.id, input="x")
    assert caught.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert httpx.post(f"{gateway}/v1/responses", json={"model": "ad-qv"}).status_code == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "image", "url": "x"}]}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": 3}}}},
         "text"),
    ],
)  # fmt: skip
def test_a_bad_response_request_is_a_400_naming_it(gateway, body, param):
    got = httpx.post(f"{gateway}/v1/responses", json={"model": "ad-qv", **body})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param, got.text


def test_a_job_its_worker_refuses_fails_the_response(client):
    """An input past the model's context is refused by the worker: a 400 naming
    ``input``, or, streamed, ``response.failed`` after ``response.created``; neither
    is stored."""
    long = "the lazy dog sleeps " * 800  # past the tiny model's 2048 tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="ad-qv", input=long)
    assert caught.value.body["param"] == "input"
    events = list(client.responses.create(model="ad-qv", input=long, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress",
                                        "response.failed"]  # fmt: skip
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "invalid_prompt"
    assert "prompt" in failed.error.message
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(failed.id)
