"""Wire records: round trips and clear errors for malformed or unknown-version records."""

import orjson
import pytest

from lorapool.lifecycle.chunk_log import OutputAssembler
from lorapool.lifecycle.submit import build_job
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.records.chunk import Chunk, Delta, decode_chunk, encode_chunk
from lorapool.records.job import decode_job, encode_job


def _chunk(seq, tokens, text, finished=False):
    out = Delta(text=text, token_ids=tokens, finish_reason="length" if finished else None)
    lora = LoRARequest("a", 3, "/a")
    return Chunk(
        request_id="r1",
        seq=seq,
        offset=seq * 2,
        outputs=[out],
        finished=finished,
        lora_request=lora if seq == 0 or finished else None,
        adapter_id=3,
        prompt_token_ids=[1, 2] if seq == 0 else None,
    )


def test_job_round_trip():
    job = build_job(
        {"prompt_token_ids": [1, 2, 3]},
        SamplingParams(max_tokens=4, seed=7),
        LoRARequest("a", 3, "/a"),
        "r1",
        {"user": "u"},
    )
    back = decode_job(encode_job(job))
    assert back.request_id == "r1" and back.prompt_token_ids == [1, 2, 3]
    assert back.sampling_params == job.sampling_params
    assert back.lora_request.adapter_id == 3 and back.metadata == {"user": "u"}


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"{nope", "not valid JSON"),
        (None, "no 'data' field"),
        (b"[1]", "expected an object"),
        (orjson.dumps({"v": 2, "request_id": "x"}), "unknown wire version 2"),
        (orjson.dumps({"v": 1, "request_id": ""}), "request_id"),
        (orjson.dumps({"v": 1, "request_id": "x"}), "needs a non-empty prompt"),
        (
            orjson.dumps({"v": 1, "request_id": "x", "prompt_token_ids": ["a"]}),
            r"prompt_token_ids\[0\]",
        ),
        (
            orjson.dumps(
                {"v": 1, "request_id": "x", "prompt": "p", "sampling_params": {"top_p": 0}}
            ),
            "top_p",
        ),
        (
            orjson.dumps(
                {"v": 1, "request_id": "x", "prompt": "p", "sampling_params": {"bogus": 1}}
            ),
            "bogus",
        ),
    ],
)
def test_bad_jobs_name_the_problem(payload, message):
    with pytest.raises(ValueError, match=message):
        decode_job(payload)


def test_build_job_validates():
    with pytest.raises(ValueError, match="empty"):
        build_job("", None, None, None, None)
    params = SamplingParams()
    params.temperature = -1.0  # mutated after construction
    with pytest.raises(ValueError, match="temperature"):
        build_job("p", params, None, None, None)
    with pytest.raises(ValueError, match="braces"):
        build_job("p", None, None, "a{b}", None)


def test_chunk_round_trip_and_version():
    chunk = _chunk(0, [5, 6], "ab")
    assert decode_chunk(encode_chunk(chunk), chunk.request_id) == chunk
    with pytest.raises(ValueError, match="unknown wire version"):
        decode_chunk(orjson.dumps({**orjson.loads(encode_chunk(chunk)), "v": 9}))


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("delta", [("ab", False), ("cd", True)]),
        ("cumulative", [("ab", False), ("abcd", True)]),
        ("final_only", [("abcd", True)]),
    ],
)
def test_assembler_kinds(kind, expected):
    assembler = OutputAssembler(kind)
    got = [assembler.feed(c) for c in (_chunk(0, [5, 6], "ab"), _chunk(1, [7, 8], "cd", True))]
    got = [o for o in got if o is not None]
    assert [(o.outputs[0].text, o.finished) for o in got] == expected
    assert all(o.lora_request.adapter_id == 3 and o.prompt_token_ids == [1, 2] for o in got)
