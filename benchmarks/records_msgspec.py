"""``bench records``' msgspec candidate (benchmarks/records.py): ``msgspec.Struct``
definitions with the compact names as field names, a typed completion delta, bounds
as ``Meta`` constraints."""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import msgspec
import orjson
from records_cases import LORA, METRICS

from lorapool.outputs import CompletionOutput
from lorapool.records import job as wire


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
