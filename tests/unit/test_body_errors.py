"""A body its Struct refuses is a 400 naming the request's own parameter (``param``, the
top-level one) and, in the message, the path inside it, what the type there accepts (worded
from the same Struct) and the value given: bytes (the gateway) and a dict (a batch line)
alike."""

import orjson
import pytest

from lorapool.openai.errors import APIError
from lorapool.openai.params import parse_chat, parse_completion, parse_job
from lorapool.records.bounds import MAX_STOP, MAX_STOP_CHARS

COMPLETION = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

CASES = [
    (COMPLETION, {"n": 0}, "n", ["n must be an integer in [1, ", "got 0"]),
    (COMPLETION, {"top_k": 2.5}, "top_k", ["top_k must be an integer", "got 2.5"]),
    (COMPLETION, {"top_p": 0}, "top_p", ["top_p must be a number in (0.0, 1.0]", "got 0"]),
    (CHAT, {"messages": [{"role": "user", "content": "x", "frobnicate": 1}]}, "messages",
     ["unknown parameter 'messages[0].frobnicate'"]),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities",
     ["modalities[1] must be one of 'text', got 'audio'"]),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio", ["audio is not supported"]),
    (CHAT, {"web_search_options": {}}, "web_search_options",
     ["web_search_options is not supported"]),
    (CHAT, {"function_call": "auto"}, "function_call", ["function_call needs functions"]),
    (CHAT, {"functions": [{"name": "f"}], "tools": [{"type": "function", "function": {
        "name": "f"}}]}, "functions", ["give functions or tools, not both"]),
    (CHAT, {"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call",
     ["function_call names 'g'"]),
    (COMPLETION, {"suffix": "x"}, "suffix", ["suffix is not supported, got 'x'"]),
    (COMPLETION, {"stream_options": {"include_usage": 1}}, "stream_options",
     ["stream_options.include_usage must be true or false, got 1"]),
    (COMPLETION, {"stop": ["a"] * (MAX_STOP + 1)}, "stop",
     [f"stop must be a list of at most {MAX_STOP} non-empty strings"]),
    (COMPLETION, {"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop",
     [f"stop[0] must be a non-empty string of at most {MAX_STOP_CHARS} characters"]),
    (COMPLETION, {"logit_bias": {"a": 1}}, "logit_bias", ["logit_bias keys must be a string"]),
    (COMPLETION, {"logit_bias": {"1": 101}}, "logit_bias",
     ["logit_bias values must be a number in [-100.0, 100.0]"]),
    (COMPLETION, {"seed": 2**63}, "seed", ["seed must be an integer in", f"got {2**63}"]),
    (COMPLETION, {"response_format": {"type": "yaml"}}, "response_format",
     ["response_format.type must be one of 'text', 'json_object', 'json_schema', got 'yaml'"]),
    (COMPLETION, {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format", ["response_format.json_schema.schema must be an object, got 3"]),
    (CHAT, {"messages": []}, "messages", ["messages must be a non-empty list", "got []"]),
    (CHAT, {"messages": [{"content": "x"}]}, "messages", ["messages[0].role is required"]),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     ["messages[0].content[0].type must be one of 'text', got 'image_url'"]),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "often"},
     "tool_choice", ["tool_choice must be one of 'auto', 'none', 'required' or an object"]),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", ["tool_choice names 'g', which is not in tools"]),
    (CHAT, {"top_logprobs": -1}, "top_logprobs", ["top_logprobs must be an integer in [0, "]),
    (CHAT, {"model": None}, "model", ["model must be a non-empty string, got None"]),
]  # fmt: skip


@pytest.mark.parametrize("as_bytes", [True, False], ids=["bytes", "dict"])
@pytest.mark.parametrize(("base", "change", "param", "says"), CASES)
def test_a_refused_body_names_its_parameter(base, change, param, says, as_bytes):
    body = {**base, **change}
    parse = parse_chat if "messages" in base else (lambda b: parse_completion(b, 4))
    with pytest.raises(APIError) as refused:
        parse(orjson.dumps(body) if as_bytes else body)
    error = refused.value
    assert (error.status, error.param) == (400, param), error.message
    for words in says:
        assert words in error.message


def test_not_an_object_and_not_json():
    for body in (b"[1, 2]", [1, 2]):
        with pytest.raises(APIError) as refused:
            parse_completion(body, 1)
        assert refused.value.param is None and "must be a JSON object" in refused.value.message
    with pytest.raises(APIError, match="not valid JSON"):
        parse_completion(b'{"model": "m",', 1)


def test_a_job_refuses_stream_and_reads_its_kind():
    with pytest.raises(APIError) as refused:
        parse_job(orjson.dumps({**COMPLETION, "stream": None}))
    assert refused.value.param == "stream"
    parsed, request_id, on_finish = parse_job(orjson.dumps({**CHAT, "request_id": "r-1"}))
    assert parsed.prompts == [{"messages": CHAT["messages"]}] and request_id == "r-1"
    with pytest.raises(APIError) as refused:
        parse_job(orjson.dumps({**COMPLETION, "top_logprobs": 1}))  # a chat's, not a prompt's
    assert refused.value.param == "top_logprobs"


# what OpenAI's clients and SDKs send by default or commonly, none of which changes the
# output: each accepted, and named as ignored
CLIENT_FIELDS = {
    "store": False, "metadata": {"app": "x"}, "service_tier": "auto",
    "reasoning_effort": "low", "prompt_cache_key": "k", "safety_identifier": "u-1",
    "verbosity": "low", "modalities": ["text"], "prediction": {"type": "content", "content": "x"},
}  # fmt: skip


@pytest.mark.parametrize("as_bytes", [True, False], ids=["bytes", "dict"])
def test_fields_clients_send_are_accepted_and_named(as_bytes):
    body = {**CHAT, **CLIENT_FIELDS, "stream_options": {"include_obfuscation": False},
            "frobnicate": 1}  # fmt: skip
    parsed = parse_chat(orjson.dumps(body) if as_bytes else body)
    assert sorted(parsed.ignored) == sorted([*CLIENT_FIELDS, "frobnicate"])
    assert parsed.prompts == [{"messages": CHAT["messages"]}]
    completion = parse_completion({**COMPLETION, "store": True, "zz": 2}, 1)
    assert completion.ignored == ["store", "zz"]
    assert parse_chat(CHAT).ignored == []


def test_a_parameter_of_another_route_is_refused_not_dropped():
    for body in ({**COMPLETION, "messages_": 1, "max_output_tokens": 4},
                 {**CHAT, "echo": True}):  # fmt: skip
        parse = parse_chat if "messages" in body else (lambda b: parse_completion(b, 1))
        with pytest.raises(APIError) as refused:
            parse(body)
        assert refused.value.param in ("max_output_tokens", "echo")
        assert "unknown parameter" in refused.value.message


def test_legacy_functions_are_tools_with_one_call():
    function = {"name": "add", "parameters": {"type": "object",
                "properties": {"a": {"type": "integer"}}, "required": ["a"]}}  # fmt: skip
    messages = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "add", "arguments": '{"a": 1}'}},
        {"role": "function", "name": "add", "content": "1"},
    ]  # fmt: skip
    parsed = parse_chat({**CHAT, "messages": messages, "functions": [function],
                         "function_call": {"name": "add"}})  # fmt: skip
    tools = parsed.tools
    assert (tools.mode, tools.name, tools.parallel, tools.legacy) == ("named", "add", False, True)
    assert tools.tools == [{"type": "function", "function": function}]
    chat = parsed.prompts[0]["messages"]
    call = {"id": "call_add", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1}'}}  # fmt: skip
    assert chat[1] == {"role": "assistant", "tool_calls": [call]}
    assert chat[2] == {"role": "tool", "content": "1", "name": "add", "tool_call_id": "call_add"}
    assert parse_chat({**CHAT, "functions": [function]}).tools.mode == "auto"
