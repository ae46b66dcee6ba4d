"""A chunk's own cost, per token, on both sides of the wire (issue 36, helper 64).

The worker's side: one engine delta (one completion, one token) to a chunk
(``worker.held.make_chunk``), its bytes (``encode_chunk``) and keeping it for the
final record (``Held.keep``); the reader's side: the bytes to a chunk
(``decode_chunk``) and a cumulative output (``OutputAssembler.feed``). Once per
request: the final chunk (metrics, adapter) and its compacted record. And a middle
chunk's encode and decode alone. Runs on this
build and on a build before ``records.chunk`` (it imports either), so a before and
after come from the same script:

    python benchmarks/chunk_codec.py [--rounds 7] [--number 20000]
"""

from __future__ import annotations

import argparse
import json
import time

from lorapool.lifecycle.chunk_log import OutputAssembler, encode_result
from lorapool.lifecycle.submit import build_job
from lorapool.outputs import CompletionOutput, RequestMetrics, RequestOutput
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.worker.held import Held, make_chunk

try:
    from lorapool.records.chunk import decode_chunk, encode_chunk
except ImportError:  # the build before records.chunk
    from lorapool.records.job import decode_chunk, encode_chunk

LORA = LoRARequest("sql-lora", 7, "/adapters/sql-lora")
PARAMS = SamplingParams(temperature=0.7, max_tokens=128, seed=42)


def _held() -> Held:
    job = build_job({"prompt_token_ids": list(range(16))}, PARAMS, LORA, "r-1", {"u": "x"})
    return Held("1-0", job)


def _delta(k: int, final: bool = False) -> RequestOutput:
    c = CompletionOutput(0, " the", [1820 + k % 7], None, None, "stop" if final else None)
    out = RequestOutput("r-1", None, list(range(16)), None, [c], final)
    if final:
        out.metrics = RequestMetrics(1.7e9, 1.7e9 + 0.01, 1.7e9 + 0.05, 1.7e9 + 2, 1.7e9 + 2)
    return out


def worker_middle(held: Held, number: int) -> float:
    """make_chunk + encode_chunk + Held.keep of a middle (1-token) delta, per call."""
    outs = [_delta(k) for k in range(number)]
    start = time.perf_counter()
    for out in outs:
        chunk = make_chunk(held, out, "w-1", held.advance([out]))
        encode_chunk(chunk)
        held.keep(chunk)
    return (time.perf_counter() - start) / number


def worker_final(number: int) -> float:
    """The final chunk and the compacted record of a 96-token request, per request."""
    helds = []
    for _ in range(number):
        held = _held()
        for k in range(95):
            out = _delta(k)
            held.keep(make_chunk(held, out, "w-1", held.advance([out])))
        helds.append(held)
    final = _delta(95, final=True)
    start = time.perf_counter()
    for held in helds:
        chunk = make_chunk(held, final, "w-1", held.advance([final]))
        encode_chunk(chunk)
        held.keep(chunk)
        encode_result(held.whole())
    return (time.perf_counter() - start) / number


def reader_middle(number: int) -> float:
    """decode_chunk + OutputAssembler("cumulative").feed of a middle chunk, per call."""
    held = _held()
    payloads = []
    for k in range(number):
        out = _delta(k)
        payloads.append(encode_chunk(make_chunk(held, out, "w-1", held.advance([out]))))
    assembler = OutputAssembler("delta")
    start = time.perf_counter()
    for payload in payloads:
        assembler.feed(decode_chunk(payload, "r-1"))
    return (time.perf_counter() - start) / number


def codec_alone(number: int) -> tuple[float, float]:
    """encode_chunk, then decode_chunk, of the same middle chunk, per call each."""
    held = _held()
    out = _delta(0)
    held.advance([out])
    chunk = make_chunk(held, out, "w-1", held.advance([out]))  # seq 1: no prompt
    start = time.perf_counter()
    for _ in range(number):
        payload = encode_chunk(chunk)
    middle = time.perf_counter()
    for _ in range(number):
        decode_chunk(payload, "r-1")
    return (middle - start) / number, (time.perf_counter() - middle) / number


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=20000)
    args = parser.parse_args()
    best: dict[str, float] = {}
    for _ in range(args.rounds):  # interleaved: drift falls on all of them
        for name, run in (
            ("worker: middle chunk", lambda: worker_middle(_held(), args.number)),
            ("worker: final chunk + record", lambda: worker_final(args.number // 100)),
            ("reader: middle chunk (delta)", lambda: reader_middle(args.number)),
        ):
            best[name] = min(best.get(name, float("inf")), run())
        encode, decode = codec_alone(args.number)
        best["encode alone"] = min(best.get("encode alone", float("inf")), encode)
        best["decode alone"] = min(best.get("decode alone", float("inf")), decode)
    print(json.dumps({name: round(s * 1e6, 2) for name, s in best.items()}))


if __name__ == "__main__":
    main()
