"""The request bodies as the OpenAPI description at ``/docs`` shows them.

Documentation only: bodies are read as JSON and checked by ``lorapool.openai.params`` and
the job boundary (``wire.job_from_dict``), so HTTP clients and Python producers meet one
check with one set of messages. The bounds shown are those checks' own constants, imported,
so the description cannot drift from what is enforced.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lorapool.lifecycle.submit import MAX_ON_FINISH
from lorapool.lifecycle.wire import MAX_REQUEST_ID
from lorapool.openai.params import MAX_USER
from lorapool.protocol import PENALTY_MAX, SEED_MAX, SEED_MIN


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="an adapter of the registry, or the base model's name")
    n: int | None = Field(None, ge=1, description="completions per prompt")
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, description="-1 (off) or at least 1")
    min_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-PENALTY_MAX, le=PENALTY_MAX)
    frequency_penalty: float | None = Field(None, ge=-PENALTY_MAX, le=PENALTY_MAX)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    user: str | None = Field(None, max_length=MAX_USER, description="kept in the job's metadata")


class _Streamed(BaseModel):
    stream: bool | None = Field(None, description="OpenAI's SSE chunks, then data: [DONE]")
    stream_options: dict[Literal["include_usage"], bool] | None = None


class CompletionRequest(_Sampling, _Streamed):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str | list[int]] = Field(
        description="a string, token ids, or a batch of either (one job each)"
    )
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, description="top alternatives per token")


class Message(BaseModel):
    role: str = Field(max_length=64)
    content: str | list[dict[str, Any]] = Field(description="text, or parts of type text")


class ChatRequest(_Sampling, _Streamed):
    """POST /v1/chat/completions: the worker applies the model's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)


class JobRequest(_Sampling):
    """POST /v1/jobs: one prompt (or one chat), read back through /v1/jobs/{id}."""

    prompt: str | list[int] | None = None
    messages: list[Message] | None = None
    max_tokens: int | None = Field(16, ge=1)
    request_id: str | None = Field(
        None,
        max_length=MAX_REQUEST_ID,
        description="the client's own id: a retry finds the same job",
    )
    on_finish: str | None = Field(
        None,
        max_length=MAX_ON_FINISH,
        description="a webhook URL (http or https) POSTed the result, signed, once it is stored",
    )


REF = "#/components/schemas/{model}"


def body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` describing a route's JSON body as ``model``."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def component_schemas() -> dict[str, Any]:
    """The request models and what they refer to, for the document's components."""
    schemas: dict[str, Any] = {}
    for model in (CompletionRequest, ChatRequest, JobRequest):
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas
