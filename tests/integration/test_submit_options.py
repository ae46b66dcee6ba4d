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


# A job built in Python may hold a lone surrogate where no check counts UTF-8 bytes;
# the job's JSON cannot hold it. Each place: (prompt, params, metadata), the path.
SURROGATE = "\udc80"
HOLDERS = [
    (PROMPT, {"stop": ["ok", "x" + SURROGATE]}, None, "sampling_params.stop[1]"),
    ({"messages": [{"role": "u" + SURROGATE, "content": "x"}]}, None, None, "messages[0].role"),
    (
        {"messages": [{"role": "user", "name": SURROGATE, "content": "x"}]},
        None,
        None,
        "messages[0].name",
    ),
    (PROMPT, None, {"k": [SURROGATE]}, "metadata"),
]


@pytest.mark.parametrize(("prompt", "params", "metadata", "field"), HOLDERS)
def test_a_lone_surrogate_is_refused_naming_its_field_and_nothing_is_enqueued(
    conn, keys, producer, prompt, params, metadata, field
):
    from lorapool.protocol import SamplingParams

    sp = SamplingParams(**params) if params else None
    with pytest.raises(FieldError, match="not valid Unicode|must be JSON") as refused:
        # a good job first: the batch is refused whole, before anything is sent
        producer.submit_many(
            [PROMPT, prompt],
            [SamplingParams(), sp or SamplingParams()],
            None,
            ["good", "bad"],
            metadata,
        )
    assert refused.value.field == field
    assert field in str(refused.value)
    assert conn.exists(keys.job("good"), keys.job("bad")) == 0
    assert sum(conn.exists(view.requests) for view in keys.shard_views) == 0


def test_an_adapter_name_no_adapter_can_have_is_unknown_without_a_look_up(conn, keys, producer):
    from lorapool.protocol import LoRARequest
    from lorapool.records.adapter import UnknownAdapter

    for name in ("a" + SURROGATE, "a b", "x" * 129):
        with pytest.raises(UnknownAdapter) as refused:
            producer.submit(PROMPT, lora_request=LoRARequest(name, 1, "/a"), request_id="r")
        assert refused.value.name == name
    assert conn.exists(keys.job("r")) == 0


def test_the_async_producer_refuses_them_the_same_way(pool_url, conn, keys):
    import asyncio

    from lorapool.producer import AsyncProducer
    from lorapool.protocol import LoRARequest, SamplingParams
    from lorapool.records.adapter import UnknownAdapter

    async def submit():
        producer = AsyncProducer(pool_url, prefix=keys.prefix, shards=keys.shards)
        try:
            lora = LoRARequest("a" + SURROGATE, 1, "/a")
            with pytest.raises(UnknownAdapter):
                await producer.submit(PROMPT, lora_request=lora, request_id="r")
            with pytest.raises(FieldError) as refused:
                await producer.submit(PROMPT, SamplingParams(stop=[SURROGATE]), request_id="r")
            assert refused.value.field == "sampling_params.stop[0]"
        finally:
            await producer.aclose()

    asyncio.run(submit())
    assert conn.exists(keys.job("r")) == 0
    assert sum(conn.exists(view.requests) for view in keys.shard_views) == 0


def test_a_lone_surrogate_in_the_request_id_is_named(conn, keys, producer):
    with pytest.raises(FieldError, match="request_id is not valid Unicode") as refused:
        producer.submit(PROMPT, request_id="r" + SURROGATE)
    assert refused.value.field == "request_id"
    assert sum(conn.exists(view.requests) for view in keys.shard_views) == 0


# any character, lone surrogates among them often (st.text rarely gives one: joined here)
ANY_TEXT = st.lists(
    st.sampled_from("aé😀\ud800\udfff") | st.characters(exclude_categories=()), max_size=8
).map("".join)


@given(st.lists(ANY_TEXT, min_size=1, max_size=3), ANY_TEXT)
def test_a_stop_string_or_role_submits_or_is_refused_as_utf8_decides(stop, role):
    """Python's own UTF-8 encoder is the oracle: what it cannot encode is a FieldError
    naming the field; anything else encodes and decodes back to the same job."""
    from lorapool.lifecycle.submit import build_job
    from lorapool.protocol import SamplingParams
    from lorapool.records.job import decode_job, encode_job

    def encodes(text):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True

    chat = {"messages": [{"role": role or "user", "content": "x"}]}
    try:
        job = build_job(chat, SamplingParams(stop=stop), None, "r", None)
    except FieldError:
        return  # refused before encoding: an empty or over-long stop, a NUL in a role...
    try:
        payload = encode_job(job)
    except FieldError as exc:
        bad = [f"sampling_params.stop[{i}]" for i, s in enumerate(stop) if not encodes(s)]
        assert exc.field in ([] if encodes(role or "user") else ["messages[0].role"]) + bad
        return
    assert all(map(encodes, [*stop, role]))
    assert decode_job(payload).to_dict() == job.to_dict()
