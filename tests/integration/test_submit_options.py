"""Submit options that ride in the job's marker: ``on_finish`` (the completion callback
that the batch issue's dispatcher runs), checked at submit, on the real Redis."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lorapool.lifecycle.submit import check_on_finish
from lorapool.protocol import FieldError

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
PROMPT = {"prompt_token_ids": [1, 2, 3]}


@pytest.mark.parametrize(
    "value",
    ["myapp.tasks.handle_result", "a.b", "https://hooks.example.com/x?y=1", "http://127.0.0.1:8/"],
)
def test_a_callback_is_kept_in_the_jobs_marker(producer, value):
    producer.submit(PROMPT, request_id="r", on_finish=value)
    assert producer.redis.hget(producer.keys.job("r"), "on_finish") == value.encode()


def test_no_callback_keeps_no_field(producer):
    producer.submit(PROMPT, request_id="r")
    assert producer.redis.hget(producer.keys.job("r"), "on_finish") is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (3, "on_finish must be a string, got int"),
        ("handle_result", "dotted function path"),
        ("ftp://x/y", "dotted function path"),
        ("my app.tasks", "printable characters without spaces"),
        ("a.b\x00c", "printable characters without spaces"),
        ("a." + "b" * 3000, "at most 2048"),
        ("1a.b", "dotted function path"),
    ],
)
def test_a_bad_callback_is_refused_naming_it_and_nothing_is_enqueued(
    conn, keys, producer, value, message
):
    with pytest.raises(FieldError, match=message):
        producer.submit(PROMPT, request_id="r", on_finish=value)
    assert conn.exists(keys.job("r")) == 0
    assert sum(conn.exists(view.requests) for view in keys.shard_views) == 0


@given(st.text(max_size=300) | st.none() | st.integers() | st.binary(max_size=20))
def test_the_check_is_total(value):
    """Any value: accepted as given (a string) or refused with FieldError, nothing else."""
    try:
        result = check_on_finish(value)
    except FieldError:
        return
    assert result == ("" if value is None else value)
