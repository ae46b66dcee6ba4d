"""The SSE frame of one event: the data line must read back as the same JSON for a
client that splits lines as the SSE spec says (LF only, here) and for one that splits
them as ``str.splitlines`` does (httpx's and requests' ``iter_lines``: also U+0085,
U+2028 and U+2029, which JSON leaves raw and a model's text holds now and then)."""

from __future__ import annotations

import orjson
from httpx._decoders import LineDecoder
from hypothesis import given
from hypothesis import strategies as st

from lorapool.gateway.streams import sse

SPLITS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
texts = st.text(st.one_of(st.sampled_from(SPLITS + "\u2027\u202a—“"), st.characters(codec="utf-8")))


def _data_lines(lines: list[str]) -> list:
    return [orjson.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]


@given(text=texts, key=texts, event_id=st.none() | st.integers(0, 2**31))
def test_every_client_reads_the_event_back(text, key, event_id):
    data = {"text": text, key: [text, 1], "id": "x"}
    frame = sse(data, "chunk", event_id)
    assert frame.endswith(b"\n\n") and b"\r" not in frame
    assert _data_lines(frame.decode().split("\n")) == [data]  # the spec's reader
    assert _data_lines(frame.decode().splitlines()) == [data]  # iter_lines()'s
    decoder, text = LineDecoder(), frame.decode()  # httpx's, fed the frame in two pieces
    lines = decoder.decode(text[: len(text) // 2]) + decoder.decode(text[len(text) // 2 :])
    assert _data_lines(lines + decoder.flush()) == [data]


def test_a_line_separator_in_a_token_is_escaped_not_dropped():
    frame = sse({"text": "a\u2028b\x85c\u2029d"})
    assert frame == b'data: {"text":"a\\u2028b\\u0085c\\u2029d"}\n\n'
