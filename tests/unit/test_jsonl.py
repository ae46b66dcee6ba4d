"""``lorapool.jsonl.dumps_line``: the value back from orjson, on one line for every
reader (``str.splitlines`` ends lines at U+0085, U+2028 and U+2029 too)."""

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from lorapool.jsonl import dumps_line

ENDS = "\x85\u2028\u2029\n\r\x0b\x0c\x1c\x1d\x1e"
values = st.recursive(
    st.one_of(
        st.none(),
        st.integers(-(2**63), 2**63 - 1),
        st.text(),
        st.text(alphabet=ENDS + "ab\u00e9\u2027"),
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_one_line_the_same_value(value):
    line = dumps_line(value)
    assert len(line.decode().splitlines()) == 1
    assert orjson.loads(line) == value
    assert not any(end in line.decode() for end in "\x85\u2028\u2029"), line


def test_the_line_ends_are_escaped_and_nothing_else_changes():
    assert dumps_line({"t": "a\x85b\u2028c\u2029d"}) == b'{"t":"a\\u0085b\\u2028c\\u2029d"}'
    assert dumps_line({"t": "\u00e9\u2027\u202a"}) == orjson.dumps({"t": "\u00e9\u2027\u202a"})
