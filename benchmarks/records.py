"""Typed wire records: what a validation library costs per chunk and per job (issue 36).

The candidates for "one typed definition per record", each encoding and decoding the
same records to the same compact JSON (checked before timing):

- ``baseline``: today's code (``lifecycle.wire``: a ``Chunk`` dataclass with dict
  completions, a compact dict built by hand, orjson; ``decode_job``'s hand checks);
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

    lorapool bench records [--rounds 9] [--number 20000] [--json out.json]
"""

from __future__ import annotations

import argparse
import enum
import json
import platform
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson

try:
    import msgspec
    import pydantic
except ImportError as exc:  # msgspec: a dependency once the records use it (phase 2)
    raise SystemExit(f"benchmarks/records.py needs msgspec and pydantic: {exc}") from None
from pydantic import BaseModel, ConfigDict, Field

from lorapool.lifecycle import wire
from lorapool.outputs import CompletionOutput, RequestMetrics
from lorapool.protocol import LoRARequest, SamplingParams

# --- the records each candidate encodes ------------------------------------------------

LORA = LoRARequest("sql-lora", 7, "/adapters/sql-lora")
MIDDLE = CompletionOutput(0, " the", [1820], None, None)
FINAL = CompletionOutput(0, ".", [13], -12.5, None, "stop", None)
METRICS = RequestMetrics(1.7e9, 1.7e9 + 0.01, 1.7e9 + 0.05, 1.7e9 + 2.0, 1.7e9 + 2.0, 0.01)
METRICS.num_prompt_tokens, METRICS.num_generated_tokens = 16, 96
JOB = wire.Job(
    "6f1c2b9e8a7d4c3b2a1f0e9d8c7b6a5f",
    "Summarize the following text in one sentence: " + "lorem ipsum dolor sit amet " * 10,
    None,
    SamplingParams(temperature=0.7, top_p=0.95, max_tokens=128, stop=["\n\n"], seed=42),
    LORA,
    {"user": "u-123", "tenant": "acme"},
)
JOB_BYTES = wire.encode_job(JOB)


# --- baseline: today's lifecycle.wire ----------------------------------------------------


def baseline_encode(c: CompletionOutput, final: bool) -> bytes:
    chunk = wire.Chunk("rid", 5 if not final else 95, 5, [wire.completion_wire(c, 5)], final)
    chunk.adapter_id = LORA.lora_int_id
    if final:
        chunk.lora_request, chunk.worker = LORA.to_dict(), "worker-1"
        chunk.metrics = METRICS.to_dict()
    return wire.encode_chunk(chunk)


def baseline_decode(raw: bytes) -> Any:
    return wire.decode_chunk(raw, "rid")


# --- msgspec ------------------------------------------------------------------------------


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


LogprobRow = tuple[int, float, "int | None", "str | None"]


class MDelta(msgspec.Struct, omit_defaults=True, kw_only=True, gc=False):
    """One completion's delta in a chunk (names are the wire's)."""

    t: str
    k: list[int]
    i: int = 0
    o: int | None = None  # None: the chunk's offset
    l: list[list[tuple[int, float, int | None, str | None]] | None] | None = None  # noqa: E741
    c: float | None = None
    f: FinishReason | None = None
    r: int | str | None = None


class MLora(msgspec.Struct, omit_defaults=False, gc=False):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None


class MMetrics(msgspec.Struct, gc=False):
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0


class MChunk(msgspec.Struct, omit_defaults=True, kw_only=True, gc=False):
    s: int
    o: int = 0
    c: list[MDelta]
    f: int = 0
    a: int = 0
    lora: MLora | None = None
    m: MMetrics | None = None
    w: str | None = None
    e: str | None = None
    p: str | None = None
    pi: list[int] | None = None


M_ENCODER = msgspec.json.Encoder()
M_DECODER = msgspec.json.Decoder(MChunk)
_FINISH = {r.value: r for r in FinishReason}


def msgspec_encode(c: CompletionOutput, final: bool) -> bytes:
    delta = MDelta(t=c.text, k=list(c.token_ids), i=c.index, c=c.cumulative_logprob)
    if c.finish_reason is not None:
        delta.f = _FINISH[c.finish_reason]
    if c.stop_reason is not None:
        delta.r = c.stop_reason
    chunk = MChunk(s=5 if not final else 95, o=5, c=[delta], a=LORA.lora_int_id)
    if final:
        chunk.f, chunk.w = 1, "worker-1"
        chunk.lora = MLora(LORA.lora_name, LORA.lora_int_id, LORA.lora_path)
        m = METRICS
        chunk.m = MMetrics(
            m.arrival_time,
            m.first_scheduled_time,
            m.first_token_time,
            m.last_token_time,
            m.finished_time,
            m.time_in_queue,
            m.num_prompt_tokens,
            m.num_generated_tokens,
            m.num_cached_tokens,
        )
    return M_ENCODER.encode(chunk)


def msgspec_decode(raw: bytes) -> MChunk:
    chunk = M_DECODER.decode(raw)
    for d in chunk.c:  # an offset left out is the chunk's (filled here, not in
        if d.o is None:  # __post_init__, which runs at construction too)
            d.o = chunk.o
    return chunk


# a job, with the sampling bounds written once as constraints
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]


class MSampling(msgspec.Struct, kw_only=True, gc=False, forbid_unknown_fields=True):
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = -1
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None  # [-2**63, 2**64 - 1]: past int64, checked below
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = 16
    min_tokens: NonNeg = 0
    stop: list[Annotated[str, msgspec.Meta(min_length=1)]] = []
    stop_token_ids: list[Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: NonNeg | None = None
    prompt_logprobs: NonNeg | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: Literal["cumulative", "delta", "final_only"] = "cumulative"
    logit_bias: dict[int, Annotated[float, msgspec.Meta(ge=-100, le=100)]] | None = None
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self):
        if self.top_k == 0:
            raise ValueError("sampling_params.top_k must be -1 (disabled) or at least 1, got 0")
        if self.seed is not None and not -(2**63) <= self.seed <= 2**64 - 1:
            raise ValueError("sampling_params.seed is out of range")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("sampling_params.min_tokens must not exceed max_tokens")


class MJob(msgspec.Struct, kw_only=True, gc=False, forbid_unknown_fields=True):
    v: Literal[1] = 1
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[^{}\x00]*$")]
    prompt: str | None = None
    prompt_token_ids: list[Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]] | None = None
    sampling_params: MSampling = msgspec.field(default_factory=MSampling)
    lora_request: MLora | None = None
    metadata: dict[str, Any] = {}
    arrival_time: Annotated[float, msgspec.Meta(ge=0)] | None = None
    result_ttl_s: Annotated[int, msgspec.Meta(ge=1, le=366 * 24 * 3600)] | None = None
    messages: list[dict[str, str]] | None = None

    def __post_init__(self):  # what a type cannot say: sizes, and one prompt
        if self.messages is None and not self.prompt and self.prompt_token_ids is None:
            raise ValueError("the job needs a non-empty prompt, prompt_token_ids or messages")
        size = 4 * len(self.prompt_token_ids or ()) + len((self.prompt or "").encode())
        if size > wire.DEFAULT_MAX_PROMPT_BYTES:
            raise ValueError(f"the prompt is {size} bytes, over the limit")
        if len(orjson.dumps(self.metadata)) > wire.MAX_METADATA_BYTES:
            raise ValueError("metadata is over the limit")


MJOB_DECODER = msgspec.json.Decoder(MJob)


def msgspec_job_decode(raw: bytes) -> MJob:
    return MJOB_DECODER.decode(raw)


def msgspec_job_encode(job: MJob) -> bytes:
    return M_ENCODER.encode(job)


# --- pydantic v2 ---------------------------------------------------------------------------


class PDelta(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    text: str = Field(alias="t")
    token_ids: list[int] = Field(alias="k")
    index: int = Field(0, alias="i")
    offset: int | None = Field(None, alias="o")
    logprobs: list[list[tuple[int, float, int | None, str | None]] | None] | None = Field(
        None, alias="l"
    )
    cumulative_logprob: float | None = Field(None, alias="c")
    finish_reason: Literal["stop", "length", "abort", "error"] | None = Field(None, alias="f")
    stop_reason: int | str | None = Field(None, alias="r")


class PLora(BaseModel):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None


class PMetrics(BaseModel):
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0


class PChunk(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    seq: int = Field(alias="s")
    offset: int = Field(0, alias="o")
    outputs: list[PDelta] = Field(alias="c")
    finished: int = Field(0, alias="f")
    adapter_id: int = Field(0, alias="a")
    lora_request: PLora | None = Field(None, alias="lora")
    metrics: PMetrics | None = Field(None, alias="m")
    worker: str | None = Field(None, alias="w")
    error: str | None = Field(None, alias="e")
    prompt: str | None = Field(None, alias="p")
    prompt_token_ids: list[int] | None = Field(None, alias="pi")


def _pydantic_chunk(c: CompletionOutput, final: bool, make) -> PChunk:
    delta = make(
        PDelta,
        text=c.text,
        token_ids=list(c.token_ids),
        index=c.index,
        cumulative_logprob=c.cumulative_logprob,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )
    fields = dict(seq=5 if not final else 95, offset=5, outputs=[delta], adapter_id=7)
    if final:
        m = METRICS
        fields.update(
            finished=1,
            worker="worker-1",
            lora_request=make(PLora, **LORA.to_dict()),
            metrics=make(PMetrics, **m.to_dict()),
        )
    return make(PChunk, **fields)


def _validated(cls, **kw):
    return cls(**kw)


def _constructed(cls, **kw):
    return cls.model_construct(**kw)


def pydantic_encode(c: CompletionOutput, final: bool) -> bytes:
    chunk = _pydantic_chunk(c, final, _validated)
    return chunk.model_dump_json(by_alias=True, exclude_defaults=True).encode()


def pydantic_construct_encode(c: CompletionOutput, final: bool) -> bytes:
    chunk = _pydantic_chunk(c, final, _constructed)
    return chunk.model_dump_json(by_alias=True, exclude_defaults=True).encode()


def pydantic_decode(raw: bytes) -> PChunk:
    chunk = PChunk.model_validate_json(raw)
    for d in chunk.outputs:
        if d.offset is None:
            d.offset = chunk.offset
    return chunk


PPenalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class PSampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    n: Annotated[int, Field(ge=1)] = 1
    temperature: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    presence_penalty: PPenalty = 0.0
    frequency_penalty: PPenalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop: list[Annotated[str, Field(min_length=1)]] = []
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Annotated[int, Field(ge=0)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: Literal["cumulative", "delta", "final_only"] = "cumulative"
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    structured_outputs: dict[str, Any] | None = None

    @pydantic.model_validator(mode="after")
    def _cross(self):
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or at least 1, got 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self


class PJob(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    v: Literal[1] = 1
    request_id: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^{}\x00]*$")]
    prompt: str | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = None
    sampling_params: PSampling = Field(default_factory=PSampling)
    lora_request: PLora | None = None
    metadata: dict[str, Any] = {}
    arrival_time: Annotated[float, Field(ge=0)] | None = None
    result_ttl_s: Annotated[int, Field(ge=1, le=366 * 24 * 3600)] | None = None
    messages: list[dict[str, str]] | None = None

    @pydantic.model_validator(mode="after")
    def _sizes(self):
        if self.messages is None and not self.prompt and self.prompt_token_ids is None:
            raise ValueError("the job needs a non-empty prompt, prompt_token_ids or messages")
        size = 4 * len(self.prompt_token_ids or ()) + len((self.prompt or "").encode())
        if size > wire.DEFAULT_MAX_PROMPT_BYTES:
            raise ValueError(f"the prompt is {size} bytes, over the limit")
        if len(orjson.dumps(self.metadata)) > wire.MAX_METADATA_BYTES:
            raise ValueError("metadata is over the limit")
        return self


def pydantic_job_decode(raw: bytes) -> PJob:
    return PJob.model_validate_json(raw)


def pydantic_job_encode(job: PJob) -> bytes:
    return job.model_dump_json().encode()


# --- slotted dataclasses with orjson, typed, by hand ------------------------------------------


@dataclass(slots=True)
class DDelta:
    text: str
    token_ids: list[int]
    index: int = 0
    offset: int = 0
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def to_wire(self, chunk_offset: int) -> dict[str, Any]:
        record: dict[str, Any] = {"t": self.text, "k": self.token_ids}
        if self.index:
            record["i"] = self.index
        if self.offset != chunk_offset:
            record["o"] = self.offset
        for key, value in (
            ("l", self.logprobs),
            ("c", self.cumulative_logprob),
            ("f", self.finish_reason),
            ("r", self.stop_reason),
        ):
            if value is not None:
                record[key] = value
        return record

    @classmethod
    def from_wire(cls, r: dict[str, Any], chunk_offset: int) -> DDelta:
        text, ids = r["t"], r["k"]
        if not (isinstance(text, str) and isinstance(ids, list)):
            raise ValueError("bad completion text or ids")
        return cls(
            text,
            ids,
            r.get("i", 0),
            r.get("o", chunk_offset),
            r.get("l"),
            r.get("c"),
            r.get("f"),
            r.get("r"),
        )


def dataclass_encode(c: CompletionOutput, final: bool) -> bytes:
    delta = DDelta(
        c.text, list(c.token_ids), c.index, 5, None, c.cumulative_logprob, c.finish_reason
    )
    record: dict[str, Any] = {"s": 95 if final else 5, "o": 5, "c": [delta.to_wire(5)]}
    if final:
        record["f"] = 1
    record["a"] = LORA.lora_int_id
    if final:
        record["lora"], record["m"] = LORA.to_dict(), METRICS.to_dict()
        record["w"] = "worker-1"
    return orjson.dumps(record)


def dataclass_decode(raw: bytes) -> Any:
    data = orjson.loads(raw)
    offset = data.get("o", 0)
    return [DDelta.from_wire(r, offset) for r in data["c"]], data


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
