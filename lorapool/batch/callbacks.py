"""Completion callbacks: once a request's final record is durable (the audit writer
has committed its row), an RQ job (JSON-serialized, never pickled) is enqueued with
what the request produced, once per request:

    {"request_id", "text", "outputs": [{"index", "text", "num_tokens", "finish_reason"}],
     "finish_reason", "num_prompt_tokens", "num_generated_tokens", "error",
     "adapter": {name, id, path, sha256, rank, alpha, target_modules, base_model} | null,
     "base_model": {name, sha256}, "worker", "metadata"}

``on_finish`` is the dotted path of the function to call with it, or an http(s) URL:
then the built-in ``post_webhook`` POSTs the same JSON, signed with HMAC-SHA256
(header ``X-Lorapool-Signature: sha256=<hex>``, key from ``$LORAPOOL_WEBHOOK_SECRET``
on the RQ worker), retried with backoff by RQ until it answers 2xx.

``on_finish`` is given at submit (``Producer.submit(..., on_finish=...)``) and kept in
the job's marker hash, where the dispatcher reads it when the record is committed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import asdict
from typing import Any

import orjson
import redis
from rq import Queue, Retry
from rq.exceptions import DuplicateJobError
from rq.serializers import JSONSerializer

from lorapool.audit_record import AuditRecord
from lorapool.lifecycle.keys import Keys
from lorapool.lifecycle.submit import check_on_finish
from lorapool.protocol import FieldError

ON_FINISH = "on_finish"
DEFAULT_QUEUE = "lorapool-callbacks"
SIGNATURE_HEADER = "X-Lorapool-Signature"
SECRET_ENV = "LORAPOOL_WEBHOOK_SECRET"
MARKER_TTL_S = 7 * 24 * 3600
WEBHOOK_RETRY = Retry(max=5, interval=[1, 2, 4, 8, 16])


def payload(record: AuditRecord) -> dict[str, Any]:
    """What a callback receives about one finished request."""
    outputs = [
        {"index": o.index, "text": o.text, "num_tokens": len(o.token_ids),
         "finish_reason": o.finish_reason}
        for o in record.outputs
    ]  # fmt: skip
    first = record.outputs[0] if record.outputs else None
    return {
        "request_id": record.request_id,
        "text": first.text if first else "",
        "outputs": outputs,
        "finish_reason": first.finish_reason if first else "error",
        "num_prompt_tokens": len(record.prompt_token_ids),
        "num_generated_tokens": sum(o["num_tokens"] for o in outputs),
        "error": record.error,
        "adapter": None if record.adapter is None else asdict(record.adapter),
        "base_model": asdict(record.base_model),
        "worker": record.worker,
        "metadata": record.metadata,
    }


def job_id(request_id: str) -> str:
    """The RQ job id of a request's callback (RQ ids are letters, digits, - and _)."""
    return "lorapool-cb-" + hashlib.sha256(request_id.encode()).hexdigest()[:40]


class Callbacks:
    """Enqueues the callbacks of committed audit records on one RQ queue."""

    def __init__(self, connection: redis.Redis, keys: Keys, queue: str = DEFAULT_QUEUE):
        self.redis, self.keys = connection, keys
        self.queue = Queue(queue, connection=connection, serializer=JSONSerializer)

    def marker(self, request_id: str) -> str:
        """Set once the request's callback is in RQ."""
        return self.keys.callback(request_id)

    def __call__(self, records: list[AuditRecord]) -> int:
        """Dispatch the callbacks of committed records; how many were enqueued."""
        with self.redis.pipeline(transaction=False) as pipe:
            for record in records:
                pipe.hget(self.keys.job(record.request_id), ON_FINISH)
                pipe.exists(self.marker(record.request_id))
            replies = pipe.execute()
        targets = zip(records, replies[::2], replies[1::2])
        return sum(self.dispatch(r, t.decode()) for r, t, done in targets if t and not done)

    def dispatch(self, record: AuditRecord, target: str) -> bool:
        """Enqueue ``record``'s callback to ``target`` (checked again, as at submit) unless
        RQ holds it already (its unique job id); whether this call enqueued it. A marker
        kept a week stops later redeliveries before they reach RQ."""
        try:
            check_on_finish(target)
        except FieldError:
            return False  # refused at submit: a marker written around the producer
        webhook = target.startswith(("http://", "https://"))
        args = (target, payload(record)) if webhook else (payload(record),)
        func = "lorapool.batch.callbacks.post_webhook" if webhook else target
        try:
            self.queue.enqueue(
                func, *args, job_id=job_id(record.request_id), unique=True,
                retry=WEBHOOK_RETRY if webhook else None, result_ttl=24 * 3600,
            )  # fmt: skip
            enqueued = True
        except DuplicateJobError:
            enqueued = False
        self.redis.set(self.marker(record.request_id), 1, ex=MARKER_TTL_S)
        return enqueued


def signature(body: bytes, secret: bytes) -> str:
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def post_webhook(url: str, data: dict[str, Any], timeout: float = 10.0) -> int:
    """POST ``data`` to ``url`` signed with ``$LORAPOOL_WEBHOOK_SECRET``; raises on
    anything but 2xx, so RQ retries it with backoff."""
    import urllib.request

    secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise RuntimeError(f"${SECRET_ENV} is not set on this RQ worker")
    body = orjson.dumps(data)
    request = urllib.request.Request(url, data=body, method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header(SIGNATURE_HEADER, signature(body, secret.encode()))
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
        return response.status
