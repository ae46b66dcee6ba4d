"""Typed wire records: what a validation library costs per chunk and per job (issue 36).

The candidates for "one typed definition per record", each encoding and decoding the
same records to the same compact JSON (checked before timing):

- ``baseline``: today's code (``records.chunk``'s ``Chunk``, a msgspec Struct since
  issue 36's helper 64; before it, a dataclass with dict completions, a compact dict
  built by hand, orjson; ``records.job``'s ``decode_job`` with its hand checks);
- ``msgspec``: ``msgspec.Struct`` definitions with the compact names as field names
  (``omit_defaults``), a typed completion delta, bounds as ``Meta`` constraints;
- ``pydantic``: pydantic v2 ``BaseModel`` definitions with aliases and ``Field``
  bounds; encode by building the model (validated) and ``model_dump_json``; and the
  same with ``model_construct`` (no validation on the worker's side);
- ``dataclass+orjson``: slotted dataclasses with ``to_wire``/``from_wire`` by hand
  (typed, the baseline's technique without the dict stage).

Operations, per record:

- chunk encode (the worker's sender thread, once per request per trip): from the
  engine's ``CompletionOutput`` delta to the bytes APPEND takes; a middle chunk (one
  completion, 1 token) and a final one (metrics, adapter, worker);
- chunk decode (every reader, per chunk): bytes to a typed chunk whose completions
  carry their offsets;
- job decode (the worker, once per job; producers validate the same at submit):
  bytes to a validated job (a 300-character prompt, sampling parameters, an adapter);
- job encode (producers, once per job).

Interleaved: each round times every candidate once (``--number`` calls each, the
best of ``--rounds``), so the machine's drift falls on all of them.

The candidates live in ``records_msgspec.py``, ``records_pydantic.py`` and
``records_dataclass.py``, the records they encode in ``records_cases.py``.

    lorapool bench records [--rounds 9] [--number 20000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import orjson

try:
    import msgspec
    import pydantic
except ImportError as exc:  # msgspec: a dependency once the records use it (phase 2)
    raise SystemExit(f"benchmarks/records.py needs msgspec and pydantic: {exc}") from None

from lorapool.outputs import CompletionOutput
from lorapool.records import job as wire
from lorapool.records.chunk import Chunk, Delta, decode_chunk, encode_chunk

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records_cases import FINAL, JOB, JOB_BYTES, LORA, METRICS, MIDDLE  # noqa: E402
from records_dataclass import dataclass_decode, dataclass_encode  # noqa: E402
from records_msgspec import (  # noqa: E402
    msgspec_decode,
    msgspec_encode,
    msgspec_job_decode,
    msgspec_job_encode,
)
from records_pydantic import (  # noqa: E402
    pydantic_construct_encode,
    pydantic_decode,
    pydantic_encode,
    pydantic_job_decode,
    pydantic_job_encode,
)

# --- baseline: today's records.chunk (a msgspec Struct since issue 36's helper 64) ---


def baseline_encode(c: CompletionOutput, final: bool) -> bytes:
    chunk = Chunk(
        request_id="rid",
        seq=5 if not final else 95,
        offset=5,
        outputs=[Delta.of(c)],
        finished=final,
        adapter_id=LORA.lora_int_id,
    )
    if final:
        chunk.lora_request, chunk.worker = LORA.to_dict(), "worker-1"
        chunk.metrics = METRICS.to_dict()
    return encode_chunk(chunk)


def baseline_decode(raw: bytes) -> Any:
    return decode_chunk(raw, "rid")


# --- timing -----------------------------------------------------------------------------------

CHUNK_ENCODERS = {
    "baseline": baseline_encode,
    "msgspec": msgspec_encode,
    "pydantic": pydantic_encode,
    "pydantic (model_construct)": pydantic_construct_encode,
    "dataclass+orjson": dataclass_encode,
}
CHUNK_DECODERS = {
    "baseline": baseline_decode,
    "msgspec": msgspec_decode,
    "pydantic": pydantic_decode,
    "dataclass+orjson": dataclass_decode,
}


def _check_same_wire() -> None:
    """Every candidate writes what today's readers read as the baseline's chunk (a
    nested default may be left out), and reads the baseline's back to the same delta."""
    for final, c in ((False, MIDDLE), (True, FINAL)):
        want = baseline_decode(baseline_encode(c, final)).to_output().to_dict()
        for name, encode in CHUNK_ENCODERS.items():
            got = baseline_decode(encode(c, final)).to_output().to_dict()
            assert got == want, (name, got, want)
        raw = baseline_encode(c, final)
        assert msgspec_decode(raw).c[0].o == 5 and pydantic_decode(raw).outputs[0].offset == 5
    mjob, pjob = msgspec_job_decode(JOB_BYTES), pydantic_job_decode(JOB_BYTES)
    assert mjob.sampling_params.stop == ["\n\n"] == pjob.sampling_params.stop
    for bad in (b'{"request_id": "x", "prompt": "p", "sampling_params": {"top_p": 0}}',
                b'{"request_id": "x", "prompt": "p", "sampling_params": {"n": true}}'):  # fmt: skip
        for decode in (wire.decode_job, msgspec_job_decode, pydantic_job_decode):
            try:
                decode(bad)
            except (ValueError, msgspec.ValidationError):
                continue
            raise AssertionError(f"{decode.__name__} accepted {bad!r}")


def _time(fn, args, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn(*args)
    return (time.perf_counter() - start) / number * 1e6


def measure(rounds: int, number: int) -> dict[str, dict[str, float]]:
    """Best µs per call of every (operation, candidate), interleaved over ``rounds``."""
    cases: dict[str, dict[str, tuple]] = {}
    for final, label, c in ((False, "middle", MIDDLE), (True, "final", FINAL)):
        cases[f"chunk encode ({label})"] = {n: (f, (c, final)) for n, f in CHUNK_ENCODERS.items()}
        raw = baseline_encode(c, final)
        cases[f"chunk decode ({label})"] = {n: (f, (raw,)) for n, f in CHUNK_DECODERS.items()}
    cases["job decode (validated)"] = {
        "baseline": (wire.decode_job, (JOB_BYTES,)),
        "msgspec": (msgspec_job_decode, (JOB_BYTES,)),
        "pydantic": (pydantic_job_decode, (JOB_BYTES,)),
    }
    mjob, pjob = msgspec_job_decode(JOB_BYTES), pydantic_job_decode(JOB_BYTES)
    cases["job encode"] = {
        "baseline": (wire.encode_job, (JOB,)),
        "msgspec": (msgspec_job_encode, (mjob,)),
        "pydantic": (pydantic_job_encode, (pjob,)),
    }
    best: dict[str, dict[str, float]] = {op: {} for op in cases}
    for _ in range(rounds):
        for op, candidates in cases.items():
            n = number // 10 if op.startswith("job") else number
            for name, (fn, args) in candidates.items():
                us = _time(fn, args, n)
                best[op][name] = min(best[op].get(name, us), us)
    return best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    _check_same_wire()
    best = measure(args.rounds, args.number)
    print(f"python {platform.python_version()}, msgspec {msgspec.__version__}, "
          f"pydantic {pydantic.VERSION}, orjson {orjson.__version__}")  # fmt: skip
    for op, results in best.items():
        base = results["baseline"]
        print(f"\n{op}: µs per call (best of {args.rounds} rounds), ratio to baseline")
        for name, us in sorted(results.items(), key=lambda kv: kv[1]):
            print(f"  {name:28s} {us:8.3f}   {us / base:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best, f, indent=1)
    return best


if __name__ == "__main__":
    main()
