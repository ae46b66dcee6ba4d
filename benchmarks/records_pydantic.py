"""``bench records``' pydantic v2 candidate (benchmarks/records.py): ``BaseModel``
definitions with aliases and ``Field`` bounds, encoded validated or with
``model_construct``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
import pydantic
from pydantic import BaseModel, ConfigDict, Field
from records_cases import LORA, METRICS

from lorapool.outputs import CompletionOutput
from lorapool.records import job as wire


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
