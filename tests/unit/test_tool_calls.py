"""Tool calls read from a model's text, whole and streamed: the parsers per family, the
stream of OpenAI deltas (joined as a client joins them, they give the calls the whole
reply gives, wherever the text is cut), and the chat a tool-less template gets."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorapool.openai.tool_stream import ToolStream
from lorapool.openai.tools import ToolRequest
from lorapool.tool_calls import (
    parse_tool_calls,
    parser_for,
    plain_chat,
    renders_tools,
    required_schema,
    scan_required,
    template_chat,
)

TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
            None,
            [("f", '{"a":1}')],
        ),
        (
            'Let me look. <tool_call>{"name":"f","arguments":{}}</tool_call>\n'
            '<tool_call>{"name":"g","arguments":{"b":"é"}}</tool_call>',
            "Let me look.",
            [("f", "{}"), ("g", '{"b":"é"}')],
        ),
        (  # SmolLM2's: a list in one block
            '<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]'
            "</tool_call>",
            None,
            [("f", "{}"), ("g", "{}")],
        ),
        ('<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a":1}')]),  # no close
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ("plain text", "plain text", []),
    ],
)
def test_hermes(text, content, calls):
    got_content, got = parse_tool_calls(text, "hermes")
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls


@pytest.mark.parametrize(
    "text, calls",
    [
        ('{"name": "f", "parameters": {"a": 1}}', [("f", '{"a":1}')]),
        (
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {}}',
            [("f", "{}"), ("g", "{}")],
        ),  # fmt: skip
        ("The answer is 4.", []),
        ('{"a": 1}', []),
    ],
)
def test_llama3_json(text, calls):
    content, got = parse_tool_calls(text, "llama3_json")
    assert [(c.name, c.arguments) for c in got] == calls
    assert content == (None if calls else text)


def test_the_parser_follows_the_model_family():
    assert parser_for("Meta-Llama-3.1-8B-Instruct") == "llama3_json"
    assert parser_for("Qwen2.5-7B-Instruct") == parser_for("SmolLM2-135M-Instruct") == "hermes"
    assert parser_for(None) == "hermes"


def test_scan_required_reads_a_partial_list():
    text = '[{"name":"f","arguments":{"s":"}\\"]"}},{"name":"g","arguments":{"x":[1,'
    assert scan_required(text) == [("f", '{"s":"}\\"]"}', True), ("g", '{"x":[1,', False)]
    assert scan_required("[") == []
    assert scan_required('[{"name":"f","arguments":3}]') == [("f", "3", True)]


def _request(mode: str, parser: str = "hermes") -> ToolRequest:
    return ToolRequest(TOOLS, mode, "f" if mode == "named" else None, True, parser)


REPLIES = {
    ("required", "hermes"): '[{"name":"f","arguments":{"q":"a,b}"}},{"name":"g","arguments":{}}]',
    ("named", "hermes"): '{"city":"Paris","n":[1,2]}',
    ("auto", "hermes"): 'Sure. <tool_call>\n{"name":"g","arguments":{"z":null}}\n</tool_call>',
    ("auto", "llama3_json"): '{"name":"f","parameters":{"k":1}};{"name":"g","parameters":{}}',
    ("none", "hermes"): "<tool_call>{}</tool_call> as text",
}


@settings(max_examples=60, deadline=None)
@given(key=st.sampled_from(sorted(REPLIES)), cuts=st.lists(st.integers(0, 80), max_size=8))
def test_streamed_deltas_join_to_the_whole_reply(key, cuts):
    mode, parser = key
    text = REPLIES[key]
    request = _request(mode, parser)
    content, calls = request.reply(text)
    stream, joined, got_content = ToolStream(request), {}, ""
    pieces = [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)])]
    for piece in [*pieces, None]:
        more, deltas = stream.feed(piece) if piece is not None else stream.finish()
        got_content += more
        for d in deltas:
            call = joined.setdefault(d["index"], {"name": "", "arguments": ""})
            assert ("id" in d) == (call["name"] == ""), d  # the id and name come first, once
            call["name"] += d.get("function", {}).get("name", "")
            call["arguments"] += d["function"].get("arguments", "")
    assert [(c["name"], c["arguments"]) for c in joined.values()] == [
        (c.name, c.arguments) for c in calls
    ]
    assert got_content.strip() == (content or "").strip()


def test_required_schema_lists_calls_to_the_tools():
    schema = required_schema(TOOLS, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["f"], ["g"]]
    assert "maxItems" not in required_schema(TOOLS, parallel=True)


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_a_template_without_tools_gets_them_as_text():
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    plain = plain_chat(chat, TOOLS)
    assert plain[0]["role"] == "system" and plain[0]["content"].startswith("Be brief.")
    assert '"name":"f"' in plain[0]["content"] and "<tools>" in plain[0]["content"]
    assert plain[2]["content"] == '<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>'
    assert plain[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    assert all(set(m) == {"role", "content"} for m in plain)


def test_a_template_with_tools_gets_arguments_as_objects():
    [message] = template_chat([{"role": "assistant", "content": "", "tool_calls": [CALL]}])
    assert message["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert renders_tools("{% if tools %}...{% endif %}")
    assert renders_tools({"default": "x", "tool_use": "y"}) and not renders_tools("{{ x }}")
    assert json.loads(CALL["function"]["arguments"]) == {"a": 1}  # the input is untouched


TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }}:"
    "{{ t['function'].get('parameters', {}) | tojson }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}[call {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}]{% endfor %}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_template_with_tools_renders_them_as_transformers_does(tiny_tokenizer_path):
    """The worker's prompt of a chat job with tools, against transformers'
    apply_chat_template(tools=...) on a template that has a place for them."""
    from transformers import AutoTokenizer

    from lorapool.records.job import job_from_dict
    from lorapool.worker.prompt import engine_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_path)
    tokenizer.chat_template = TOOLS_TEMPLATE
    chat = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    job = job_from_dict({"request_id": "r", "messages": chat, "tools": TOOLS})

    class Engine:
        def get_tokenizer(self):
            return tokenizer

    got = engine_prompt(job, Engine())
    want = tokenizer.apply_chat_template(
        template_chat(chat), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert got == want
    assert '<tools>f:{"type": "object"};g:' in got and '[call f {"a": 1}]' in got
