"""The bodies of the job API: a job's status name, its result and its chunk events."""

from __future__ import annotations

from typing import Any

from lorapool.openai.format import usage
from lorapool.outputs import RequestOutput
from lorapool.records.adapter import AdapterRecord, ModelIdentity
from lorapool.records.chunk import Chunk
from lorapool.records.marker import JobStatus

# what a tenant's key sees of a chunk's LoRARequest: never lora_path nor base_model_name
# (the server's absolute paths)
TENANT_LORA_FIELDS = ("lora_name", "lora_int_id")


def state_name(state: dict[str, Any], output: RequestOutput | None) -> str:
    """A ``JobStatus`` (queued, finished, failed) or what the job API says beside them:
    running (started, not ended) or aborted (every completion ended by abort)."""
    if output is None:
        return "running" if state["started"] else JobStatus.QUEUED.value
    if output.error or state["status"] == JobStatus.FAILED:
        return JobStatus.FAILED.value
    if output.outputs and all(c.finish_reason == "abort" for c in output.outputs):
        return "aborted"
    return JobStatus.FINISHED.value


def adapter_identity(
    output: RequestOutput, record: AdapterRecord | None, internals: bool = True
) -> dict[str, Any] | None:
    """Name, id and (with ``internals``) path of the adapter that ran the job, and its
    weights' sha256 (from the registry record of that name and id)."""
    lora = output.lora_request
    if lora is None:
        return None
    same = record is not None and record.id == lora.lora_int_id
    identity = {"name": lora.lora_name, "id": lora.lora_int_id, "path": lora.lora_path}
    if not internals:
        del identity["path"]
    return {**identity, "sha256": record.sha256 if same else None}


def job_body(
    job_id: str,
    status: str,
    output: RequestOutput,
    adapter: AdapterRecord | None,
    base: ModelIdentity | None,
    internals: bool = True,
) -> dict[str, Any]:
    """GET /v1/jobs/{id} of a final job; without ``internals`` (a tenant's key) no
    adapter path and no worker name, and errors name the job by ``job_id``."""
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    identity = adapter_identity(output, adapter, internals)
    error = output.error
    if error and output.request_id:
        error = error.replace(output.request_id, job_id)
    result = {
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in output.outputs
        ],
        "prompt": output.prompt,
        "prompt_token_ids": output.prompt_token_ids,
        "usage": usage(len(output.prompt_token_ids or ()), completion_tokens),
        "adapter": identity,
        "base_model": base.to_dict() if base else None,
        "worker": output.worker if internals else None,
        "error": error,
    }
    model = identity["name"] if identity else base.name if base else None
    return {"id": job_id, "object": "job", "status": status, "model": model, "result": result}


def chunk_event(chunk: Chunk, public_id: str | None = None) -> dict[str, Any]:
    """One chunk as the events stream sends it (its seq is the event id). With a
    ``public_id`` (a tenant's key): no adapter path and no worker, and errors name the
    job by that id."""
    event: dict[str, Any] = {
        "seq": chunk.seq,
        "outputs": [
            {
                "index": o.index,
                "text": o.text,
                "token_ids": o.token_ids,
                "finish_reason": o.finish_reason,
            }
            for o in chunk.outputs
        ],
        "finished": chunk.finished,
    }
    for name in ("error", "worker"):
        value = getattr(chunk, name)
        if value is not None:
            event[name] = value
    if chunk.lora_request is not None:
        event["lora_request"] = chunk.lora_request.to_dict()
    if public_id is not None:
        event.pop("worker", None)
        if isinstance(event.get("lora_request"), dict):  # no server path (lora_path,
            lora = event["lora_request"]  # base_model_name): the adapter's name and id only
            event["lora_request"] = {k: lora[k] for k in TENANT_LORA_FIELDS if k in lora}
        if event.get("error"):
            event["error"] = event["error"].replace(chunk.request_id, public_id)
    return event
