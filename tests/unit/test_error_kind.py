"""A failed request's kind travels in its chunks and final record, and readers route by
it, not by the error's wording; chunks written before kinds read by the old text rule."""

from __future__ import annotations

import pytest

from lorapool.lifecycle.chunk_log import OutputAssembler, decode_result, encode_result
from lorapool.openai.errors import APIError, failed_request
from lorapool.openai.format import check_failed
from lorapool.protocol import FieldError, LoRARequest
from lorapool.records.accumulator import Accumulator
from lorapool.records.adapter import UnknownAdapter, check_lora
from lorapool.records.chunk import Chunk, Delta, decode_chunk, encode_chunk
from lorapool.records.error_kind import ErrorKind
from lorapool.records.job import job_from_dict

# Final chunks as main at 89a94dd wrote them (``encode_chunk``), before kinds: an engine
# step that raised, and a request the engine refused.
OLD_ENGINE = (
    b'{"s":2,"o":3,"c":[{"t":"","k":[],"f":"error"}],"f":1,"a":7,"m":{"arrival_time":1.5,'
    b'"finished_time":2.5,"num_prompt_tokens":4,"num_generated_tokens":3},"w":"w1","e":'
    b'"engine step failed: RuntimeError: CUDA error: device-side assert triggered"}'
)
OLD_REQUEST = (
    b'{"s":0,"c":[{"t":"","k":[],"o":3,"f":"error"}],"f":1,"w":"w1","e":"request r-req: '
    b"the prompt has 297 tokens; the model's context is 256, which leaves no room to "
    b'generate"}'
)
FAILED = [Delta(text="", token_ids=[], offset=0, finish_reason="error")]
A = [Delta(text="a", token_ids=[1])]


def failed(error: str, kind: ErrorKind | None) -> Chunk:
    return Chunk(
        request_id="r",
        seq=0,
        outputs=FAILED,
        finished=True,
        worker="w1",
        error=error,
        error_kind=kind,
    )


def status(chunk: Chunk) -> int:
    with pytest.raises(APIError) as caught:
        check_failed(chunk.to_output(), "public")
    return caught.value.status


def test_chunks_written_before_kinds_read_by_the_old_rule():
    engine, request = decode_chunk(OLD_ENGINE, "r-eng"), decode_chunk(OLD_REQUEST, "r-req")
    assert engine.error_kind is ErrorKind.ENGINE and request.error_kind is ErrorKind.REQUEST
    assert status(engine) == 500 and status(request) == 400
    assert decode_result(OLD_ENGINE, "r-eng").error_kind is ErrorKind.ENGINE


def test_the_kind_is_on_the_wire_and_readers_route_by_it_not_the_text():
    # wording that the old rule would read the other way round
    step = failed("the step broke", ErrorKind.ENGINE)
    mislabelled = failed("engine step failed, says the request's own text", ErrorKind.REQUEST)
    assert b'"ek":"engine"' in encode_chunk(step)
    for chunk, want in ((step, 500), (mislabelled, 400)):
        read = decode_chunk(encode_chunk(chunk), "r")
        assert read.error_kind is chunk.error_kind and status(read) == want
        assert decode_result(encode_result(chunk), "r").error_kind is chunk.error_kind


def test_a_kind_this_build_does_not_know_reads_by_the_old_rule():
    raw = encode_chunk(failed("engine step failed: x", None))[:-1] + b',"ek":"new"}'
    assert decode_chunk(raw, "r").error_kind is ErrorKind.ENGINE


def test_chunks_without_an_error_have_no_kind_and_cost_no_key():
    chunk = Chunk(request_id="r", seq=0, outputs=A)
    assert b"ek" not in encode_chunk(chunk)
    assert decode_chunk(encode_chunk(chunk), "r").error_kind is None


def test_the_kind_survives_accumulation_and_assembly():
    first = Chunk(request_id="r", seq=0, outputs=A)
    last = Chunk(
        request_id="r",
        seq=1,
        offset=1,
        outputs=FAILED,
        finished=True,
        error="gone",
        error_kind=ErrorKind.REMOVED,
    )
    kept = Accumulator()
    for chunk in (first, last):
        kept.add(chunk)
    assert kept.whole("r").error_kind is ErrorKind.REMOVED
    for kind in ("delta", "cumulative", "final_only"):
        assembler = OutputAssembler(kind)
        outputs = [assembler.feed(first), assembler.feed(last)]
        assert outputs[-1].error_kind == "removed" and outputs[-1].to_dict()["error_kind"]


def test_failed_request_by_kind():
    assert failed_request("x", ErrorKind.ENGINE, "req-1", "cmpl-9").status == 500
    for kind in ErrorKind:
        if kind is not ErrorKind.ENGINE:
            error = failed_request("req-1: its adapter did not load", kind, "req-1", "cmpl-9")
            assert (error.status, error.param) == (400, None)  # no path: no parameter
            assert error.message == "cmpl-9: its adapter did not load"
            path = failed_request("req-1: x", kind, "req-1", "cmpl-9", path="adapter")
            assert (path.status, path.param) == (400, "model")


def test_the_job_boundary_names_the_job_and_the_registry_the_adapter():
    with pytest.raises(FieldError) as caught:
        job_from_dict({"request_id": "job-7", "prompt": "hi", "metadata": 3})
    assert caught.value.request_id == "job-7" and str(caught.value).startswith("job job-7: ")
    with pytest.raises(UnknownAdapter) as unknown:
        check_lora(LoRARequest("ghost", 1, ""), None)
    assert unknown.value.name == "ghost" and "unknown adapter 'ghost'" in str(unknown.value)
