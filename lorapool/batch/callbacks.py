"""Completion callbacks: once a request's final record is durable (the audit writer
has committed its row), its callback is dispatched, once per request.

``on_finish`` is the dotted path of a function, or an http(s) URL (a webhook):

- a function: an RQ job (JSON-serialized, never pickled) calls it with what the
  request produced: ``{"request_id", "text", "outputs": [{"index", "text",
  "num_tokens", "finish_reason"}], "finish_reason", "num_prompt_tokens",
  "num_generated_tokens", "error", "adapter": {name, id, path, sha256, rank, alpha,
  target_modules, base_model} | null, "base_model": {name, sha256}, "worker",
  "metadata"}`` (the operator's own code: it sees everything);
- a webhook: the receiver is a tenant's, so it gets an event without the pool's
  internals (no adapter path, no worker, the job id the tenant knows), signed as the
  Standard Webhooks spec says with its tenant's secret, delivered through the tenant's
  lane (``lorapool.batch.deliveries``: fairness, retries, dead letter) and
  ``lorapool.egress`` (no inward URLs):
  ``{"id": "msg_...", "object": "event", "type": "job.completed" | "job.failed",
  "created_at", "data": {"id", "object": "job", "status", "model", "outputs", "text",
  "finish_reason", "usage", "error", "adapter": {name, id, sha256, rank, alpha,
  target_modules} | null, "base_model", "metadata", "finished_at"}}``.

``on_finish`` is given at submit (``Producer.submit(..., on_finish=...)``) and kept in
the job's marker hash, where the dispatcher reads it when the record is committed.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import orjson
import redis
from rq import Queue
from rq.exceptions import DuplicateJobError
from rq.serializers import JSONSerializer

from lorapool.batch.deliveries import DEFAULT_QUEUE, Lanes, WebhookConfig, delivery_id
from lorapool.lifecycle.keys import Keys
from lorapool.lifecycle.submit import check_on_finish
from lorapool.protocol import FieldError
from lorapool.records.audit import AuditRecord

ON_FINISH = "on_finish"
MARKER_TTL_S = 7 * 24 * 3600
INTERNAL_METADATA = ("key_id",)  # metadata the gateway adds that the tenant never gave


def payload(record: AuditRecord) -> dict[str, Any]:
    """What a function callback receives about one finished request."""
    outputs = _outputs(record)
    first = record.outputs[0] if record.outputs else None
    return {
        "request_id": record.request_id,
        "text": first.text if first else "",
        "outputs": outputs,
        "finish_reason": first.finish_reason if first else "error",
        "num_prompt_tokens": len(record.prompt_token_ids),
        "num_generated_tokens": sum(o["num_tokens"] for o in outputs),
        "error": record.error,
        "adapter": None if record.adapter is None else record.adapter.to_dict(),
        "base_model": record.base_model.to_dict(),
        "worker": record.worker,
        "metadata": record.metadata,
    }


def _outputs(record: AuditRecord) -> list[dict[str, Any]]:
    return [
        {"index": o.index, "text": o.text, "num_tokens": len(o.token_ids),
         "finish_reason": o.finish_reason}
        for o in record.outputs
    ]  # fmt: skip


def public_id(record: AuditRecord) -> str:
    """The job id its tenant knows (the gateway's request ids are ``<tenant>~<id>``)."""
    tenant = (record.metadata or {}).get("tenant")
    if tenant and record.request_id.startswith(f"{tenant}~"):
        return record.request_id[len(tenant) + 1 :]
    return record.request_id


def event(record: AuditRecord, msg_id: str, now: float | None = None) -> dict[str, Any]:
    """The webhook event of one finished request: nothing of the pool's internals."""
    data = payload(record)
    rid, external = record.request_id, public_id(record)
    error = None if record.error is None else record.error.replace(rid, external)
    adapter = data["adapter"]
    if adapter is not None:
        adapter = {k: v for k, v in adapter.items() if k not in ("path", "base_model")}
    failed = bool(error) or data["finish_reason"] == "error"
    metadata = {k: v for k, v in (record.metadata or {}).items() if k not in INTERNAL_METADATA}
    prompt, generated = data["num_prompt_tokens"], data["num_generated_tokens"]
    usage = {"prompt_tokens": prompt, "completion_tokens": generated,
             "total_tokens": prompt + generated}  # fmt: skip
    body = {
        "id": external, "object": "job", "status": "failed" if failed else "finished",
        "model": adapter["name"] if adapter else record.base_model.name,
        "outputs": data["outputs"], "text": data["text"], "finish_reason": data["finish_reason"],
        "usage": usage, "error": error, "adapter": adapter, "base_model": data["base_model"],
        "metadata": metadata, "finished_at": record.metrics.finished_time,
    }  # fmt: skip
    return {
        "id": msg_id,
        "object": "event",
        "type": "job.failed" if failed else "job.completed",
        "created_at": int(time.time() if now is None else now),
        "data": body,
    }


def job_id(request_id: str) -> str:
    """The RQ job id of a request's callback (RQ ids are letters, digits, - and _)."""
    return "lorapool-cb-" + hashlib.sha256(request_id.encode()).hexdigest()[:40]


class Callbacks:
    """Dispatches the callbacks of committed audit records: functions as RQ jobs on
    ``queue``, webhooks into their tenant's lane (``webhooks``: how they are sent)."""

    def __init__(
        self,
        connection: redis.Redis,
        keys: Keys,
        queue: str = DEFAULT_QUEUE,
        webhooks: WebhookConfig | None = None,
    ):
        self.redis, self.keys = connection, keys
        self.queue = Queue(queue, connection=connection, serializer=JSONSerializer)
        webhooks = webhooks or WebhookConfig(keys.prefix, keys.shards, queue)
        self.lanes = Lanes(connection, webhooks)

    def marker(self, request_id: str) -> str:
        """Set once the request's callback is dispatched."""
        return self.keys.callback(request_id)

    def __call__(self, records: list[AuditRecord]) -> int:
        """Dispatch the callbacks of committed records; how many were dispatched. Every
        lane with deliveries waiting or in flight is pumped too (leases that ended)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for record in records:
                pipe.hget(self.keys.job(record.request_id), ON_FINISH)
                pipe.exists(self.marker(record.request_id))
            replies = pipe.execute()
        targets = zip(records, replies[::2], replies[1::2])
        count = sum(self.dispatch(r, t.decode()) for r, t, done in targets if t and not done)
        self.lanes.pump_all()
        return count

    def dispatch(self, record: AuditRecord, target: str) -> bool:
        """Dispatch ``record``'s callback to ``target`` (checked again, as at submit)
        unless it was dispatched before; whether this call did. A marker kept a week
        stops later redeliveries before they reach RQ or a lane."""
        try:
            check_on_finish(target)
        except FieldError:
            return False  # refused at submit: a marker written around the producer
        if target.startswith(("http://", "https://")):
            msg_id = delivery_id(self.keys.prefix, record.request_id)
            body = orjson.dumps(event(record, msg_id))
            tenant = str((record.metadata or {}).get("tenant") or "")
            dispatched = self.lanes.push(msg_id, tenant, target, body)
        else:
            dispatched = self._enqueue(record, target)
        self.redis.set(self.marker(record.request_id), 1, ex=MARKER_TTL_S)
        return dispatched

    def _enqueue(self, record: AuditRecord, target: str) -> bool:
        try:
            self.queue.enqueue(
                target, payload(record), job_id=job_id(record.request_id), unique=True,
                result_ttl=24 * 3600,
            )  # fmt: skip
            return True
        except DuplicateJobError:
            return False
