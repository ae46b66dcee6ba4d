"""What an asyncio client may ask of a pool besides submitting: is Redis there, which
base model and adapters it serves, which workers are alive, where a job stands.

The gateway's read side: it names no Redis key itself (``lorapool.lifecycle.keys`` owns them,
``producer/`` reads them). Torch-free.
"""

from __future__ import annotations

from typing import Any

from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.producer.aio import AsyncProducer
from lorapool.producer.api_keys import authenticate
from lorapool.records.adapter import (
    AdapterRecord,
    ModelIdentity,
    decode_adapter_record,
    decode_model_identity,
)
from lorapool.records.api_key import KeyRecord, decode_key_record
from lorapool.records.heartbeat import Heartbeat, decode_heartbeats
from lorapool.records.marker import RESULT_FIELD, job_status


class PoolView:
    """Read-only questions about the pool of an ``AsyncProducer`` (same connection)."""

    def __init__(self, producer: AsyncProducer):
        self.redis = producer.redis
        self.keys = producer.keys

    async def ping(self) -> bool:
        """True when Redis answers (raises redis's ConnectionError when it does not)."""
        return bool(await self.redis.ping())

    async def base_model(self) -> ModelIdentity | None:
        """The pool's base model; None before any worker started (ValueError: a
        malformed record)."""
        return decode_model_identity(await self.redis.get(self.keys.model))

    async def adapters(self) -> list[AdapterRecord]:
        """Every registry record, by adapter id."""
        records = [decode_adapter_record(v) for v in await self.redis.hvals(self.keys.adapters)]
        return sorted(records, key=lambda r: r.id)

    async def adapter(self, name: str) -> AdapterRecord | None:
        return decode_adapter_record(await self.redis.hget(self.keys.adapters, name))

    async def api_key(self, key: str) -> KeyRecord | None:
        """The record (tenant, role, adapters) of an API key; None if unknown or revoked."""
        return await authenticate(self.redis, self.keys, key)

    async def api_key_by_id(self, key_id: str) -> KeyRecord | None:
        """The record of the key with id ``key_id`` (a dashboard session's); None once
        revoked."""
        return decode_key_record(await self.redis.hget(self.keys.api_keys, key_id))

    async def has_webhook_secret(self, tenant: str) -> bool:
        """Whether deliveries of ``tenant`` ('' for none) can be signed."""
        return bool(await self.redis.hexists(self.keys.webhook_secrets, tenant))

    async def live_workers(self) -> list[Heartbeat]:
        """Heartbeat records of the workers whose liveness flag has not expired."""
        records = decode_heartbeats(await self.redis.hgetall(self.keys.workers))
        alive = await self.redis.mget([self.keys.alive(n) for n in records]) if records else []
        return [h for h, flag in zip(records.values(), alive) if flag is not None]

    async def job_state(self, request_id: str) -> dict[str, Any] | None:
        """A job's ``status`` (queued, finished, failed), whether its output has begun
        (``started``), whether its final record is in (``final``) and its chunk log is
        still there (``log``: not yet compacted); None for an unknown id."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(self.keys.run(request_id), "status", RESULT_FIELD)
            pipe.exists(self.keys.out(request_id))
            pipe.exists(self.keys.job(request_id))
            (ran, result), log, submitted = await pipe.execute()
        status = job_status(ran, submitted)
        if status is None:
            return None
        return {
            "status": status,
            "started": bool(log or result),
            "final": bool(result),
            "log": bool(log),
        }

    async def backlog(self) -> int:
        """Entries of the request streams (every shard's) not yet delivered to any worker
        (the group's lag; the stream's length when Redis cannot say)."""
        return sum([await self._backlog(view.requests) for view in self.keys.shard_views])

    async def _backlog(self, stream: str) -> int:
        try:
            groups = await self.redis.xinfo_groups(stream)
        except Exception:  # noqa: BLE001 - no stream yet
            return 0
        for group in groups:
            if group["name"] in (WORKERS_GROUP, WORKERS_GROUP.encode()):
                lag = group.get("lag")
                return int(lag) if lag is not None else int(group.get("pending", 0))
        return int(await self.redis.xlen(stream))
