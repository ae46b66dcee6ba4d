"""A batch's state in Redis: one hash per batch, in OpenAI's states and shape.

    validating -> in_progress -> finalizing -> completed
        |              |             `-> expired (past its completion window)
        `-> failed     `-> cancelling -> cancelled

Every change of status is one Lua call that checks the status it leaves, so a cancel
and the collector finishing race safely. The key is ``{p}:batch:<id>`` (to join
``lorapool/lifecycle/keys.py``; named only here until then).
"""

from __future__ import annotations

import time
import uuid
from enum import Enum
from typing import Any

import orjson
import redis

from lorapool.connection import register_script
from lorapool.lifecycle.keys import Keys


class Status(str, Enum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


FINAL = {Status.COMPLETED, Status.FAILED, Status.EXPIRED, Status.CANCELLED}
# the timestamp field OpenAI sets on entering each status
STAMP = {
    Status.IN_PROGRESS: "in_progress_at",
    Status.FINALIZING: "finalizing_at",
    Status.COMPLETED: "completed_at",
    Status.FAILED: "failed_at",
    Status.EXPIRED: "expired_at",
    Status.CANCELLING: "cancelling_at",
    Status.CANCELLED: "cancelled_at",
}
WINDOWS = {"24h": 24 * 3600}
_JSON_FIELDS = {"errors", "metadata"}
USAGE = ("input_tokens", "output_tokens", "cached_tokens")  # summed over the batch's lines
_INT_FIELDS = {"total", "completed", "failed", "created_at", "expires_at", *STAMP.values()}
_INT_FIELDS |= set(USAGE)

# KEYS: batch hash. ARGV: new status, stamp field, now, allowed old statuses...
# Returns the status before (the change made only if it was allowed), false if no batch.
MOVE_SCRIPT = """
local old = redis.call('HGET', KEYS[1], 'status')
if not old then return false end
for i = 4, #ARGV do
  if ARGV[i] == old then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
    return old
  end
end
return old
"""


def batch_key(keys: Keys, batch_id: str) -> str:
    return keys.batch(batch_id)


class BatchState:
    """Reads and changes of batch records under one key prefix."""

    def __init__(self, connection: redis.Redis, keys: Keys):
        self.redis, self.keys = connection, keys
        self._move = register_script(connection, MOVE_SCRIPT)

    def create(
        self,
        input_file_id: str,
        endpoint: str,
        window: str,
        metadata: dict | None = None,
        owner: dict | None = None,
    ) -> dict[str, Any]:
        """A new batch; ``owner``: the tenant and key id that made it (its lines carry
        them into their jobs' metadata, and only that tenant sees it over HTTP)."""
        batch_id, now = f"batch_{uuid.uuid4().hex}", int(time.time())
        record = {
            "id": batch_id,
            "status": Status.VALIDATING.value,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": window,
            "created_at": now,
            "expires_at": now + WINDOWS[window],
            "total": 0,
            "completed": 0,
            "failed": 0,
            "metadata": orjson.dumps(metadata or {}),
            "owner": orjson.dumps(owner or {}),
        }
        with self.redis.pipeline(transaction=False) as pipe:  # both keys on the meta slot
            pipe.hset(batch_key(self.keys, batch_id), mapping=record)
            pipe.zadd(self.keys.batches, {batch_id: time.time()})  # exact order, not seconds
            pipe.execute()
        return self.get(batch_id)

    def get(self, batch_id: str) -> dict[str, Any] | None:
        """The batch as OpenAI's Batch object; None if unknown."""
        raw = self.redis.hgetall(batch_key(self.keys, batch_id))
        return None if not raw else openai_shape(_decode(raw))

    def owner(self, batch_id: str) -> dict[str, Any]:
        """The tenant and key id that made the batch ({} when made without a tenant)."""
        raw = self.redis.hget(batch_key(self.keys, batch_id), "owner")
        return orjson.loads(raw) if raw else {}

    def status(self, batch_id: str) -> Status | None:
        raw = self.redis.hget(batch_key(self.keys, batch_id), "status")
        return None if raw is None else Status(raw.decode())

    def move(self, batch_id: str, to: Status, *allowed: Status) -> bool:
        """Set ``to`` if the batch is in one of ``allowed``; whether it was."""
        args = [to.value, STAMP.get(to, "updated_at"), int(time.time())]
        old = self._move(
            keys=[batch_key(self.keys, batch_id)], args=args + [s.value for s in allowed]
        )
        return old is not None and old.decode() in {s.value for s in allowed}

    def set(self, batch_id: str, **fields: Any) -> None:
        values = {k: orjson.dumps(v) if k in _JSON_FIELDS else v for k, v in fields.items()}
        self.redis.hset(batch_key(self.keys, batch_id), mapping=values)

    def count(
        self, batch_id: str, completed: int = 0, failed: int = 0, usage: dict | None = None
    ) -> None:
        """Add to the line counts, and ``usage`` (``USAGE``'s fields) to the batch's."""
        key = batch_key(self.keys, batch_id)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hincrby(key, "completed", completed)
            pipe.hincrby(key, "failed", failed)
            for name, value in (usage or {}).items():
                pipe.hincrby(key, name, value)
            pipe.execute()

    def delete(self, batch_id: str) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(batch_key(self.keys, batch_id))
            pipe.zrem(self.keys.batches, batch_id)
            pipe.execute()


def _decode(raw: dict[bytes, bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in raw.items():
        name, text = k.decode(), v.decode()
        if name in _JSON_FIELDS:
            out[name] = orjson.loads(v)
        elif name in _INT_FIELDS:
            out[name] = int(text)
        else:
            out[name] = text
    return out


def openai_shape(r: dict[str, Any]) -> dict[str, Any]:
    errors = r.get("errors")
    return {
        "id": r["id"],
        "object": "batch",
        "endpoint": r["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": r["input_file_id"],
        "completion_window": r["completion_window"],
        "status": r["status"],
        "output_file_id": r.get("output_file_id"),
        "error_file_id": r.get("error_file_id"),
        "created_at": r["created_at"],
        **{field: r.get(field) for field in STAMP.values()},
        "expires_at": r.get("expires_at"),
        "request_counts": {"total": r["total"], "completed": r["completed"], "failed": r["failed"]},
        "metadata": r.get("metadata") or None,
        "usage": _usage(r),
    }


def _usage(r: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's batch ``usage``: the tokens of the lines collected so far."""
    prompt, output = r.get("input_tokens", 0), r.get("output_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": r.get("cached_tokens", 0)},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }
