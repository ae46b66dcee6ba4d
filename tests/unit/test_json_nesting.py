"""The request bodies' nesting bound (``lorapool.openai.nesting``, issue 51 row 10):
brackets inside strings do not count, the bound itself passes, one level more is a 400
before msgspec's recursion is reached."""

import contextlib
import json

import msgspec
import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from lorapool.openai.bodies import CompletionRequest, parse
from lorapool.openai.errors import APIError
from lorapool.openai.nesting import MAX_JSON_DEPTH, depth_over


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("body", "over"),
    [
        (nested(MAX_JSON_DEPTH), False),
        (nested(MAX_JSON_DEPTH + 1), True),
        (b'{"a":' * MAX_JSON_DEPTH + b"1" + b"}" * MAX_JSON_DEPTH, False),
        (b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1), True),
        (orjson.dumps(["[" * 1000, "{" * 1000]), False),  # brackets in strings
        (orjson.dumps(['\\"[' * 1000]), False),  # escaped quotes do not end a string
        (b"[" + b"[1]," * 5000 + b"[1]]", False),  # many brackets, two levels
        (bytearray(nested(5000)), True),
        (b"", False),
    ],
)
def test_depth_over(body, over):
    assert depth_over(body) is over


def depth(value) -> int:
    """The oracle: arrays and objects within each other in the decoded value."""
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


# strings made of what the scan has to tell apart: quotes, backslashes, brackets
TEXT = st.text(st.sampled_from('"\\[]{}a\n\u00e9'), max_size=8)
VALUES = st.recursive(
    st.none() | st.integers(-(2**63), 2**63 - 1) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=40,
)


@given(VALUES, st.integers(0, 12), st.booleans(), st.sampled_from(["", "x", "["]))
def test_depth_over_agrees_with_the_decoded_values_depth(value, bound, ascii_only, large):
    """Whatever the strings hold (escaped quotes, runs of backslashes, brackets),
    encoded as orjson or as Python's json (``\\u`` escapes) writes it; ``large``: past
    16 KiB, where the brackets are counted with ``find`` (in a string or not)."""
    if large:
        value = [value, large * 20000]
    body = json.dumps(value).encode() if ascii_only else orjson.dumps(value)
    assert depth_over(body, bound) is (depth(value) > bound)


def test_a_deep_body_is_a_400_naming_the_nesting_before_it_is_decoded():
    value = orjson.loads(nested(MAX_JSON_DEPTH - 3))
    ok = {"model": "m", "prompt": "x", "structured_outputs": {"json": value}}
    assert parse(orjson.dumps(ok), CompletionRequest).structured_outputs == {"json": value}
    deep = orjson.dumps(ok).replace(b"[]", nested(5000))
    with pytest.raises(APIError) as raised:
        parse(memoryview(deep), CompletionRequest)
    assert raised.value.status == 400 and raised.value.code == "json_too_deep"
    assert f"deeper than {MAX_JSON_DEPTH} levels" in raised.value.message


@pytest.mark.parametrize(
    "body",
    [b'{"made_up": 1, "prompt": ', b'{"made_up": 1, "prompt": "x", }', b'{"made_up": "\xff"'],
)
def test_a_body_broken_past_an_unknown_field_is_a_400_when_unknown_fields_are_dropped(body):
    """The typed decode stops at the first unknown field (a ValidationError); the untyped
    read of the body without it meets the broken JSON after it. That was raised inside
    the first error's handler, past the parser's own 400 for bad JSON: the routes that
    drop unknown fields (vLLM's way, chat and completions) answered 500."""
    with pytest.raises(APIError) as refused:
        parse(body, CompletionRequest, unknown=[])
    assert refused.value.status == 400 and "not valid JSON" in refused.value.message


JUNK = st.text(st.sampled_from('"\\\\[]{}a:,1 '), max_size=12).map(str.encode)


@given(JUNK, st.integers(0, 3000), JUNK, st.sampled_from([b"[", b'{"a":']))
@example(b'["a\\\\",', 3000, b"", b"[")  # an escaped backslash ends its string
def test_text_that_is_not_json_never_reaches_msgspecs_recursion_unflagged(
    head, depth, tail, opening
):
    """What the scan lets through, msgspec refuses without recursing past Python's limit:
    brackets msgspec would read before the text's first fault are counted as it reads them."""
    body = head + opening * depth + tail
    if not depth_over(body):
        with contextlib.suppress(msgspec.DecodeError):  # refused: a 400, as any non-JSON
            msgspec.json.decode(body)
