"""One JSON Lines record: orjson's encoding, with the three code points that end a
line for some readers written as escapes.

U+0085, U+2028 and U+2029 are valid raw inside a JSON string, and orjson writes them
raw; but Python's ``str.splitlines`` (what a user of OpenAI's client reaches for:
``client.files.content(id).text.splitlines()``) and some editors end a line at each.
A model's output holds them now and then (a tiny random-weight model's often), and such a
batch output line came back as two broken ones. Escaped (``\\u2028``), the record parses
to the same value and every reader sees one line. The encoding's structure is ASCII, so
their UTF-8 bytes occur only inside strings, whole.

May import: the standard library and orjson.
"""

from __future__ import annotations

from typing import Any

import orjson

_LINE_ENDS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def dumps_line(value: Any) -> bytes:
    """``value`` as JSON on one line for every reader (no trailing newline)."""
    data = orjson.dumps(value)
    for raw, escaped in _LINE_ENDS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data
