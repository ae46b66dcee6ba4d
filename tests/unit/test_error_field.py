"""A refusal's field travels as a path (issue 50): the engine's and the job boundary's
refusals name the job field they are about (``FieldError.field``), the worker's final
chunk carries it (``ep``) into the final record and every reader's output, and the
OpenAI error names the request's parameter from it rather than from the message's words.
Chunks without one (a worker of the version before paths) still read by those words."""

from __future__ import annotations

import pytest

from lorapool.engine.input_processor import InputLimits, InputProcessor
from lorapool.lifecycle.chunk_log import OutputAssembler, decode_result, encode_result
from lorapool.openai.errors import failed_request
from lorapool.protocol import FieldError, LoRARequest, SamplingParams
from lorapool.records.accumulator import Accumulator
from lorapool.records.chunk import Chunk, Delta, decode_chunk, encode_chunk
from lorapool.records.error_kind import ErrorKind

A = [Delta(text="a", token_ids=[1])]
FAILED = [Delta(text="", token_ids=[], offset=1, finish_reason="error")]


class Bytes:
    """A tokenizer of the prompt's bytes (the processor only encodes)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())


LIMITS = InputLimits(
    vocab_size=256, max_model_len=64, kv_capacity_tokens=128, max_logprobs=5, enable_lora=False
)


@pytest.mark.parametrize(
    "prompt, params, lora, path",
    [
        ("hi", SamplingParams(logprobs=9), None, "sampling_params.logprobs"),
        ("hi", SamplingParams(prompt_logprobs=9), None, "sampling_params.prompt_logprobs"),
        ("hi", SamplingParams(stop_token_ids=[999]), None, "sampling_params.stop_token_ids"),
        ("hi", SamplingParams(), LoRARequest("sql", 1, "/a"), "adapter"),
        ("x" * 64, SamplingParams(), None, "prompt"),
        ({"prompt_token_ids": [300]}, SamplingParams(), None, "prompt"),
        ("hi", SamplingParams(n=4, max_tokens=60), None, "sampling_params.n"),
    ],
)
def test_the_engine_names_the_field_it_refuses(prompt, params, lora, path):
    with pytest.raises(FieldError) as caught:
        InputProcessor(Bytes(), LIMITS).process("r-1", prompt, params, lora, None)
    assert caught.value.field == path
    assert isinstance(caught.value, ValueError)  # callers of add_request catch it as before


def final(error: str, path: str | None) -> Chunk:
    return Chunk(
        request_id="r",
        seq=1,
        offset=1,
        outputs=FAILED,
        finished=True,
        error=error,
        error_kind=ErrorKind.REQUEST,
        error_field=path,
    )


def test_the_path_travels_in_the_chunk_the_record_and_every_output():
    last = final("request r: the engine refused it", "sampling_params.seed")
    assert b'"ep":"sampling_params.seed"' in encode_chunk(last)
    assert decode_chunk(encode_chunk(last), "r").error_field == "sampling_params.seed"
    kept = Accumulator()
    for chunk in (Chunk(request_id="r", seq=0, outputs=A), last):
        kept.add(chunk)
    whole = kept.whole("r")
    assert decode_result(encode_result(whole), "r").error_field == "sampling_params.seed"
    for kind in ("delta", "cumulative", "final_only"):
        assembler = OutputAssembler(kind)
        outputs = [assembler.feed(Chunk(request_id="r", seq=0, outputs=A)), assembler.feed(last)]
        assert outputs[-1].error_field == "sampling_params.seed"


def test_a_chunk_without_a_path_costs_no_key():
    assert b'"ep"' not in encode_chunk(final("request r: refused", None))
    assert b'"ep"' not in encode_chunk(Chunk(request_id="r", seq=0, outputs=A))
    assert "error_field" not in final("x", None).to_output().to_dict()


def test_the_parameter_comes_from_the_path_not_the_words():
    def refused(message: str, names=None, path=None):
        return failed_request(message, "request", "req-1", "c-1", names, path)

    # words that name no field, and words that name another one
    plain = refused("request req-1: refused", path="sampling_params.seed")
    assert (plain.status, plain.param) == (400, "seed")
    misleading = "request req-1: the prompt has logprobs=9 over max_logprobs=5"
    chat = {"logprobs": "top_logprobs"}
    error = refused(misleading, chat, "sampling_params.logprobs")
    assert error.param == "top_logprobs" and "top_logprobs=9 over max_logprobs" in error.message
    assert refused(misleading, chat).param is None  # no path: the words are never read
    assert (
        refused(misleading, chat).message
        == "request c-1: the prompt has logprobs=9 over max_logprobs=5"
    )
    assert refused("request req-1: no", path="adapter").param == "model"
    assert refused("request req-1: refused").param is None
    grammar = refused(
        "request req-1: structured_outputs.json: bad schema",
        {"structured_outputs": "response_format"},
        "sampling_params.structured_outputs",
    )
    assert grammar.param == "response_format" and "response_format.json: bad" in grammar.message
