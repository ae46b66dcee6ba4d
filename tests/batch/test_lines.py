"""Checking a batch input file, no server: every bad line is reported with its number
and the field at fault, and nothing else is."""

import json
import uuid

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorapool.batch.lines import check_file

MODELS = {"base", "ad-1"}


def line(custom_id="a", url="/v1/completions", **body) -> bytes:
    body = {"model": "ad-1", "prompt": "hi", "max_tokens": 4, **body}
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def check(lines):
    return check_file(iter(lines), "batch_x", MODELS.__contains__)


def test_a_good_file_has_no_errors():
    body = {"model": "base", "messages": [{"role": "user", "content": "x"}]}
    chat = orjson.dumps(
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}
    )
    report = check([line("a"), b"", line("b", model="base"), chat])
    assert (report.total, report.num_errors) == (3, 0)


def test_every_bad_line_is_named_with_its_reason():
    lines = [
        line("a"),
        line("a"),  # duplicate
        line("b", model="nope"),  # unknown model
        b'{"custom_id": "c", "method": "POST",',  # malformed
        line("d", temperature=-1),  # bad parameter, through SamplingParams
        line("e", url="/v1/embeddings"),  # unknown endpoint
        orjson.dumps(
            {
                "custom_id": "f",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "base", "prompt": "x"},
                "extra": 1,
            }
        ),  # fmt: skip
        line("g\x00h"),  # NUL in the custom id
        line("i", frobnicate=True),  # unknown body parameter
        line("j", prompt=["a", "b"]),  # one prompt per line
    ]
    report = check(lines)
    found = {e["line"]: (e["param"], e["message"]) for e in report.errors}
    assert report.num_errors == 9 and report.total == 10
    assert found[2][0] == "custom_id" and "repeats line 1" in found[2][1]
    assert found[3] == ("body.model", "line 3: unknown model 'nope'")
    assert found[4][0] is None and "not valid JSON" in found[4][1]
    assert found[5][0] == "body.temperature"
    assert found[6][0] == "url"
    assert found[7][0] == "extra"
    assert found[8][0] == "custom_id"
    assert found[9][0] == "body.frobnicate"
    assert found[10][0] == "body.prompt"


def test_huge_line_and_empty_file():
    assert check([b"{" + b" " * (2 << 20) + b"}"]).errors[0]["message"].endswith("bytes")
    assert check([]).errors[0]["message"] == "line 0: the file has no requests"


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats()
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(
    field=st.sampled_from(
        [
            "custom_id",
            "method",
            "url",
            "body",
            "model",
            "prompt",
            "max_tokens",
            "temperature",
            "n",
            "stop",
        ]
    ),  # fmt: skip
    value=json_values,
)
def test_any_value_in_any_field_is_accepted_or_named(field, value):
    record = orjson.loads(line("a"))
    if field in record:
        record[field] = value
    else:
        record["body"][field] = value
    report = check([orjson.dumps(record)])
    if report.num_errors:
        error = report.errors[0]
        assert error["message"].startswith("line 1: ")
        assert (
            error["param"] is None
            or field in error["param"]
            or field == "body"
            or field in error["message"]
        )


def test_a_large_file_is_checked_a_line_at_a_time(tmp_path, conn):
    """5,000 lines: the check's peak memory stays under a quarter of the file's size (holding the
    parsed file would take many times it); only the custom_ids seen are kept."""
    import tracemalloc

    from lorapool.batch.files import FileStore
    from lorapool.lifecycle.keys import Keys

    keys = Keys(f"test-lines-{uuid.uuid4().hex[:10]}")
    store = FileStore(conn, keys)
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        for i in range(5_000):
            f.write(line(f"id-{i}", prompt=f"prompt number {i} " * 60) + b"\n")
    with open(path, "rb") as f:
        file_id = store.put(f, "big.jsonl")["id"]
    tracemalloc.start()
    report = check_file(store.lines(file_id), "batch_x", MODELS.__contains__)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (report.total, report.num_errors) == (5_000, 0)
    assert peak < path.stat().st_size / 4, (peak, path.stat().st_size)
    for key in conn.scan_iter(keys.pattern):
        conn.delete(key)


def test_stop_strings_meet_the_gateways_max_stop():
    """A line names at most the gateway's ``--max-stop`` stop strings (OpenAI's 4 by
    default), refused with the message a request over HTTP gets."""
    lines = [line("a", stop=["1", "2", "3", "4"]), line("b", stop=["1", "2", "3", "4", "5"])]
    report = check(lines)
    assert report.num_errors == 1 and report.errors[0]["line"] == 2
    assert report.errors[0]["param"] == "body.stop"
    assert report.errors[0]["message"] == (
        "line 2: stop must hold at most 4 strings (the gateway's max_stop), got 5"
    )
    narrow = check_file(iter(lines), "batch_x", MODELS.__contains__, max_stop=2)
    assert [e["line"] for e in narrow.errors] == [1, 2]
    assert "at most 2 strings" in narrow.errors[0]["message"]
    one = check_file(iter([line("c", stop="one")]), "b", MODELS.__contains__, max_stop=1)
    assert one.errors == []


def _with(**fields) -> bytes:
    record = {**orjson.loads(line("a")), **fields}
    return json.dumps(record).encode()  # the standard library's: it writes ints past 64 bits


@pytest.mark.parametrize(
    ("raw", "param", "words"),
    [
        (b"[1, 2]", None, "a line must be a JSON object, got [1, 2]"),
        (b'{"custom_id": NaN}', None, "not valid JSON"),
        (b'{"custom_id": "\xff"}', None, "not valid JSON"),  # not UTF-8
        (
            line("a", model="MARK").replace(b"MARK", b"\xff"),
            "body",
            "not valid JSON",
        ),  # in the body
        (_with(custom_id=True), "custom_id", "at most 64 characters, got True"),
        (_with(custom_id=2**70), "custom_id", f"got {2**70}"),
        (_with(custom_id=""), "custom_id", "non-empty string"),
        (_with(custom_id="x" * 65), "custom_id", "at most 64 characters"),
        (_with(custom_id="a{b}"), "custom_id", "must not hold braces or NUL"),
        (_with(method="post"), "method", "method must be one of 'POST', got 'post'"),
        (_with(method=None), "method", "got None"),
        (_with(url="/v1/completions/"), "url", "got '/v1/completions/'"),
        (_with(url=["/v1/completions"]), "url", "url must be one of"),
        (_with(body=None), "body", "must be a JSON object, got None"),
        (_with(body=[1]), "body", "got [1]"),
        (
            _with(body={"model": "ad-1", "prompt": "x", "max_tokens": True}),
            "body.max_tokens",
            "True",
        ),
        (_with(body={"model": "ad-1", "prompt": "x", "n": 2**70}), "body.n", f"got {2**70}"),
        (_with(**{"custom_id\x00": 1}), "custom_id\x00", "unknown parameter"),
    ],
)
def test_a_hostile_line_is_refused_naming_its_field(raw, param, words):
    """Wrong types, bools for ints, ints past 64 bits, NaN, bytes that are not UTF-8, NUL
    and unknown fields: each refused with the line's number and the field at fault."""
    (error,) = check([raw]).errors
    assert error["param"] == param and error["message"].startswith("line 1: "), error
    assert words in error["message"], error


def test_a_missing_field_is_named_and_unicode_ids_pass():
    record = orjson.loads(line("a"))
    for name in ("custom_id", "method", "url", "body"):
        without = orjson.dumps({k: v for k, v in record.items() if k != name})
        (error,) = check([without]).errors
        assert (error["param"], error["message"]) == (name, f"line 1: {name} is required")
    assert check([line("é中-\u200b")]).errors == []


def test_a_deeply_nested_line_is_refused_not_raised():
    """msgspec's recursion raised RecursionError out of the check (issue 51 row 10)."""
    deep = line("a").replace(b'"hi"', b"[" * 5000 + b"]" * 5000)
    (error,) = check([deep]).errors
    assert "nests arrays and objects deeper than" in error["message"], error
