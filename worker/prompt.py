"""What a job asks the engine to continue: its prompt, or its chat under the model's
chat template (applied here, as ``LLM.chat`` does, so the gateway needs no tokenizer);
``add_to_engine`` puts it in the engine, with its adapter and what was streamed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lorapool.records.adapter import check_lora, decode_adapter_record
from lorapool.records.errors import FieldError
from lorapool.records.job import Job
from lorapool.tool_calls import plain_chat, renders_tools, template_chat
from lorapool.worker.held import Held, engine_params, resumed_token_ids

if TYPE_CHECKING:
    from lorapool.worker.engine_api import EngineInterface
    from lorapool.worker.state import WorkerState


def add_to_engine(state: WorkerState, held: Held) -> None:
    """``held``'s job into the worker's engine (raises what makes it fail alone: an
    adapter not in the registry or not matching it, a resumed request with n > 1)."""
    job, engine = held.job, state.engine
    if job.lora_request is not None:
        record = decode_adapter_record(state.redis.hget(state.keys.adapters, job.lora_request.name))
        check_lora(job.lora_request, record)
        held.adapter = record  # as registered, until the engine has loaded it
        loaded = engine.expect_lora(job.lora_request, record)
        if loaded is not None:  # what its audit record says: the files that run
            held.adapter = record.as_loaded(loaded)
    if held.total and job.sampling_params.n > 1:
        raise FieldError(
            f"request {job.request_id}: cannot resume a request with n > 1 "
            f"after {held.total} tokens were streamed",
            field="sampling_params.n",
        )
    engine.add_request(
        job.request_id,
        engine_prompt(job, engine),
        engine_params(job.sampling_params),
        arrival_time=job.arrival_time,
        lora_request=job.lora_request,
        resume_token_ids=resumed_token_ids(held),
        **tenant_share(job),
    )


def tenant_share(job: Job) -> dict[str, Any]:
    """The tenant whose fair share of the engine a job runs in, and its weight: what
    the gateway wrote into its metadata from the caller's key record (``tenant``,
    ``weight``); nothing for a job without a tenant (the default tenant's, as any
    producer's straight to Redis). A weight that is not a number > 0 fails the job
    alone (``add_request``'s ValueError)."""
    metadata = job.metadata or {}
    tenant = metadata.get("tenant")
    if tenant is None:
        return {}
    return {"tenant": str(tenant), "tenant_weight": metadata.get("weight")}


def engine_prompt(job: Job, engine: EngineInterface) -> str | dict[str, Any]:
    """The prompt ``engine.add_request`` takes for ``job``.

    A chat job's messages go through the engine tokenizer's chat template with the
    generation prompt added, the text then tokenized like any prompt: the same
    tokens ``LLM.chat`` runs. Tools, tool calls and tool results go to a template that
    renders them (``tools=``, vLLM's way); a template without a place for them gets
    them as text (``lorapool.tool_calls.plain_chat``). An engine without a tokenizer,
    or a template that refuses the messages, fails this request alone (the worker's
    ``start``).
    """
    if job.messages is None:
        return job.engine_prompt
    tokenizer = engine.get_tokenizer()
    if tokenizer is None:
        raise ValueError("this worker's engine has no tokenizer: it runs no chat jobs")
    messages, extra = job.messages, {}
    uses_tools = job.tools or any("tool_calls" in m or m["role"] == "tool" for m in messages)
    if uses_tools and renders_tools(tokenizer.chat_template):
        messages, extra = template_chat(messages), {"tools": job.tools}
    elif uses_tools:
        messages = plain_chat(messages, job.tools)
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **extra
    )
