"""Chunks and a final record as main wrote them just before ``records.chunk`` (the
compact dict writer of ``801da01``; bytes captured from its ``make_chunk``,
``encode_chunk`` and ``encode_result``): two completions at their own offsets, logprobs
of the prompt and the tokens, stop reasons of both types, an error with its kind. What
the wire fixtures hold no case of. Today's writer makes the same bytes from the same
engine outputs, and today's reader reads them and writes them back unchanged."""

from __future__ import annotations

import base64
import zlib

import orjson

from lorapool.lifecycle.chunk_log import decode_result, encode_result
from lorapool.lifecycle.submit import build_job
from lorapool.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.records.chunk import decode_chunk, encode_chunk
from lorapool.worker.held import Held, make_chunk

CHUNKS = [
    (
        b'{"s":0,"c":[{"t":"a","k":[10],"l":[[[10,-0.25,1,"x"]]],"c":-0.5},{"t":'
        b'"bc","k":[11,12],"i":1,"l":[[[11,-0.25,1,"x"]],[[12,-0.25,1,"x"]]],"c"'
        b':-1.0}],"a":3,"lora":{"lora_name":"a","lora_int_id":3,"lora_path":"/a"'
        b',"base_model_name":null},"pi":[5,6,7],"pl":[null,[[6,-0.25,1,"x"]],[[7'
        b',-0.25,1,"x"]]]}'
    ),
    (b'{"s":1,"o":3,"c":[{"t":"d","k":[13],"i":1,"o":2,"l":[[[13,-0.25,1,"x"]]],"c":-0.5}],"a":3}'),
    (
        b'{"s":2,"o":4,"c":[{"t":"e","k":[14],"o":1,"l":[[[14,-0.25,1,"x"]]],"c"'
        b':-0.5,"f":"stop","r":7},{"t":"f","k":[15],"i":1,"o":3,"l":[[[15,-0.25,'
        b'1,"x"]]],"c":-0.5,"f":"stop","r":"END"}],"f":1,"a":3,"lora":{"lora_nam'
        b'e":"a","lora_int_id":3,"lora_path":"/a","base_model_name":null},"m":{"'
        b'arrival_time":1.5,"first_scheduled_time":1.6,"first_token_time":1.7,"l'
        b'ast_token_time":2.0,"finished_time":2.5,"time_in_queue":0.1,"num_promp'
        b't_tokens":3,"num_generated_tokens":6,"num_cached_tokens":0},"w":"w-64"'
        b"}"
    ),
]
FINAL = base64.b64decode(  # zlib-compressed, as stored in the job's hash
    "eAF1kcFugzAQRP9lz5sUkwAS5+baH4iQ5YDToIChxjSVIv69sylFRVFPmNn1m1nvnQbKY6aS8uOd"
    "AuVkLDFd8asiVvuCqcH5KH+baBsnrJi+qCgY0n4toRcYdCVMZ5CG0PVgecqziX/gp7I6/+IVq5jV"
    "jlWCizXlAM9Was0Vq/hZ2j1LyVr6PxAd3l5pQh054Wso38G98zjcH1/tTGvlNZBWdF27oOtq6dO9"
    "CRfUX6ThZAar266yzXzNjU0zMbVCM97Xn6bRoRagejxO7Yegh/Jiq7Gx1VJKkedRCt3VukXOEMHg"
    "wl813kbS7OoBkLkzFrbYIKz+GO0Iv2iL8dzY6t53bT8zsHKMK+q7ddabIAixRAEZpFAaSbeoEaa5"
    "YdzbJt1j4B7rOiaccoYn7GVrMjH2lK4XACVbK8X0DRletLc="
)
FAILED = (
    b'{"s":0,"c":[{"t":"","k":[],"f":"error"},{"t":"","k":[],"i":1,"f":"erro'
    b'r"}],"f":1,"a":3,"lora":{"lora_name":"a","lora_int_id":3,"lora_path":"'
    b'/a","base_model_name":null},"m":{"arrival_time":1.5,"finished_time":17'
    b'95693510.238006,"num_prompt_tokens":3,"num_generated_tokens":0},"w":"w'
    b'-64","e":"engine step failed: boom","ek":"engine","pi":[5,6,7]}'
)


def _steps():
    """The engine outputs the chunks above were made from (n = 2, one logprob)."""
    lp = lambda t: {t: Logprob(-0.25, 1, "x")}  # noqa: E731

    def out(parts, final=False):
        completions = [
            CompletionOutput(
                i, text, ids, -0.5 * len(ids), [lp(t) for t in ids], stop and "stop", stop
            )
            for i, text, ids, stop in parts
        ]
        made = RequestOutput("r-64", None, [5, 6, 7], [None, lp(6), lp(7)], completions, final)
        if final:
            made.metrics = RequestMetrics(1.5, 1.6, 1.7, 2.0, 2.5, 0.1)
        return made

    return [
        out([(0, "a", [10], None), (1, "bc", [11, 12], None)]),
        out([(1, "d", [13], None)]),
        out([(0, "e", [14], 7), (1, "f", [15], "END")], final=True),
    ]


def test_todays_writer_makes_the_same_bytes():
    params = SamplingParams(n=2, max_tokens=4, logprobs=1, prompt_logprobs=1)
    job = build_job(
        {"prompt_token_ids": [5, 6, 7]}, params, LoRARequest("a", 3, "/a"), "r-64", None
    )
    job.arrival_time = 1.5
    held = Held("1-0", job)
    for want, out in zip(CHUNKS, _steps(), strict=True):
        chunk = make_chunk(held, out, "w-64", held.advance([out]))
        held.keep(chunk)
        assert encode_chunk(chunk) == want
    assert zlib.decompress(encode_result(held.whole())) == zlib.decompress(FINAL)


def test_todays_reader_reads_them_and_writes_them_back_unchanged():
    first, second, last = (decode_chunk(raw, "r-64") for raw in CHUNKS)
    assert [(d.index, first.offset_of(d)) for d in first.outputs] == [(0, 0), (1, 0)]
    assert [(d.index, second.offset_of(d), d.text) for d in second.outputs] == [(1, 2, "d")]
    assert [d.stop_reason for d in last.outputs] == [7, "END"] and last.finished is True
    assert first.prompt_token_ids == [5, 6, 7] and first.prompt_logprobs[1] == [[6, -0.25, 1, "x"]]
    assert last.metrics.num_generated_tokens == 6 and last.lora_request.lora_int_id == 3
    whole = decode_result(FINAL, "r-64")
    assert [d.text for d in whole.outputs] == ["ae", "bcdf"] and whole.offset_of(
        whole.outputs[1]
    ) == 0
    failed = decode_chunk(FAILED, "r-64")
    assert (
        failed.error_kind == "engine" and [d.finish_reason for d in failed.outputs] == ["error"] * 2
    )
    for raw in [*CHUNKS, zlib.decompress(FINAL)]:
        assert encode_chunk(decode_chunk(raw)) == raw
    # the failed chunk's metrics were a dict of the four fields known; they are a
    # RequestMetrics now, written whole (its other fields at their defaults)
    again, was = orjson.loads(encode_chunk(decode_chunk(FAILED))), orjson.loads(FAILED)
    assert again.pop("m") == {**RequestMetrics(arrival_time=0).to_dict(), **was.pop("m")}
    assert again == was
