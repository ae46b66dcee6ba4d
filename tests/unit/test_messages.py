"""``check_messages``: its fast pass (lengths in msgspec, a NUL scan in Python) accepts
and refuses what bounds' own types (the no-NUL pattern in msgspec) do, and names the
same field."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lorapool.records import messages
from lorapool.records.errors import FieldError, check
from lorapool.records.messages import check_messages

NO_LIMIT = 1 << 20
CALL = {"id": "call_1", "type": "function", "function": {"name": "find", "arguments": "{}"}}


def _chat(role="assistant", name="bob", call_id="call_1", function="find", tool_call_id="t"):
    call = {**CALL, "id": call_id, "function": {"name": function, "arguments": "{}"}}
    return [{"role": role, "content": "x", "name": name, "tool_calls": [call]},
            {"role": "tool", "content": "y", "tool_call_id": tool_call_id}]  # fmt: skip


@pytest.mark.parametrize(
    ("chat", "field", "most"),
    [
        (_chat(role="as\x00"), "messages[0].role", 64),
        (_chat(name="\x00"), "messages[0].name", 256),
        (_chat(call_id="c\x00"), "messages[0].tool_calls[0].id", 256),
        (_chat(function="f\x00"), "messages[0].tool_calls[0].function.name", 256),
        (_chat(tool_call_id="t\x00é"), "messages[1].tool_call_id", 256),
    ],
)
def test_a_nul_in_a_role_or_a_name_is_refused_naming_it(chat, field, most):
    with pytest.raises(FieldError) as refused:
        check_messages(chat, NO_LIMIT)
    assert refused.value.field == field
    words = f"{field} must be a non-empty string of at most {most} characters without NUL, got "
    assert str(refused.value).startswith(words)


def test_a_nul_in_content_or_arguments_is_text():
    chat = _chat()
    chat[0]["content"] = "a\x00b"
    chat[0]["tool_calls"][0]["function"]["arguments"] = '{"a": "\\u0000"}\x00'
    out = check_messages(chat, NO_LIMIT)
    assert out[0]["content"] == "a\x00b"
    assert out[0]["tool_calls"][0]["function"]["arguments"].endswith("\x00")


@pytest.mark.parametrize(
    ("chat", "field"),
    [
        # msgspec meets the NUL of message 1 before the content check of message 0
        ([{"role": "user"}, {"role": "u\x00", "content": "x"}], "messages[1].role"),
        # ... and before orjson, in the size count, meets a lone surrogate (a TypeError)
        (
            [
                {"role": "assistant", "tool_calls": [{"function": {"name": "\ud800"}}]},
                {"role": "u\x00", "content": "x"},
            ],
            "messages[1].role",
        ),
        # ... and a NUL in a role before a wrong type further on
        ([{"role": "u\x00", "content": 1}], "messages[0].role"),
        ([{"content": 1, "role": "u\x00"}], "messages[0].content"),
        ([{"role": "u\x00", "content": "x"}, "\ud800"], "messages[0].role"),
        (
            [{"role": "user", "content": "x" * 100}, {"role": "u\x00", "content": "x"}],
            "messages[1].role",
        ),
    ],
)
def test_the_first_fault_msgspec_meets_is_named(chat, field):
    with pytest.raises(FieldError) as refused:
        check_messages(chat, 50)
    assert refused.value.field == field


# mostly good names, so a chat with one fault (a NUL, a length, a lone surrogate) is common
NAMES = st.sampled_from(["bob", "é", "n" * 64] * 5 + ["", "n" * 65, "x" * 257, "a\x00", "\ud800"])
TEXT = st.sampled_from(["hi", "hi", "é😀", "é😀", None, "a\x00b", "\ud800", 1])
FUNCTION = st.fixed_dictionaries({"name": NAMES}, optional={"arguments": TEXT})
CALLS = st.lists(
    st.fixed_dictionaries(
        {"function": FUNCTION}, optional={"id": NAMES, "type": st.sampled_from(["function", "f"])}
    ),
    max_size=2,
)
MESSAGE = st.fixed_dictionaries(
    {"role": NAMES},
    optional={"content": TEXT, "name": NAMES, "tool_call_id": NAMES, "tool_calls": CALLS},
)


def _outcome(checker, chat, limit):
    try:
        return checker(chat, limit)
    except Exception as exc:  # noqa: BLE001 - a lone surrogate's error is compared too
        return type(exc), str(exc), getattr(exc, "field", None)


@given(st.lists(MESSAGE, min_size=1, max_size=4), st.sampled_from([40, NO_LIMIT]))
def test_the_fast_pass_answers_as_bounds_own_types_do(chat, limit):
    def bounded(chat, limit):
        checked, size = messages._checked(
            messages._typed({"messages": chat}, messages._Bounded, "")
        )
        check(
            size <= limit,
            f"the prompt is {size} bytes, over the limit of {limit} (max_prompt_bytes)",
            "messages",
        )
        return checked

    assert _outcome(check_messages, chat, limit) == _outcome(bounded, chat, limit)
