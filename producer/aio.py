"""The asyncio producer (redis.asyncio), for web apps: same API as ``Producer``, awaited."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis.asyncio as aioredis

from lorapool.connection import connect_async
from lorapool.lifecycle import marker
from lorapool.lifecycle.chunk_log import OutputAssembler
from lorapool.lifecycle.follower import Follower
from lorapool.lifecycle.keys import DEFAULT_PREFIX, Keys
from lorapool.lifecycle.submit import Submit, build_job, check_on_finish
from lorapool.outputs import RequestOutput
from lorapool.producer.client import _deadline
from lorapool.producer.job import distinct, per_prompt
from lorapool.protocol import LoRARequest, RequestOutputKind, SamplingParams
from lorapool.records.adapter import (
    AdapterRecord,
    check_lora,
    decode_adapter_record,
    lora_from_record,
    requested_name,
)
from lorapool.records.job import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_PROMPT_BYTES,
    JobLimits,
)

logger = logging.getLogger(__name__)


class AsyncJobHandle:
    """One submitted request, for asyncio code."""

    def __init__(
        self,
        producer: AsyncProducer,
        request_id: str,
        output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE,
        enqueued: bool = True,
    ):
        self.producer = producer
        self.request_id = request_id
        self.output_kind = RequestOutputKind(output_kind)
        self.enqueued = enqueued

    async def chunks(self, after: int = -1, timeout: float | None = None) -> AsyncIterator:
        """Chunks with seq > ``after`` until the final one, through the producer's
        ``Follower`` (one connection for all the handles it follows; see
        ``JobHandle.chunks`` for the order and the compacted log)."""
        chunks = self.producer.follower.follow(self.request_id, after)
        if timeout is None:
            async for chunk in chunks:
                yield chunk
            return
        deadline = _deadline(timeout)
        try:
            while True:
                left = max(0.0, deadline - time.monotonic())
                try:
                    chunk = await asyncio.wait_for(chunks.__anext__(), left)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise asyncio.TimeoutError(
                        f"request {self.request_id}: no final output in {timeout}s"
                    ) from None
                yield chunk
        finally:
            await chunks.aclose()

    async def stream(
        self, after: int = -1, timeout: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """RequestOutputs in the job's ``output_kind`` (see ``JobHandle.stream``)."""
        assembler = OutputAssembler(self.output_kind)
        async for chunk in self.chunks(timeout=timeout):
            output = assembler.feed(chunk)
            if output is not None and chunk.seq > after:
                yield output

    async def result(self, timeout: float | None = None) -> RequestOutput:
        """The final, cumulative RequestOutput."""
        assembler = OutputAssembler(RequestOutputKind.FINAL_ONLY)
        async for chunk in self.chunks(timeout=timeout):
            output = assembler.feed(chunk)
            if output is not None:
                return output
        raise RuntimeError(f"request {self.request_id}: chunk log ended without a final chunk")

    async def abort(self) -> None:
        await self.producer.abort(self.request_id)


class AsyncProducer:
    """Enqueues jobs from asyncio code; ``connection`` is a URL or a redis.asyncio client."""

    def __init__(
        self,
        connection: str | aioredis.Redis,
        prefix: str = DEFAULT_PREFIX,
        max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
        max_n: int = DEFAULT_MAX_N,
        result_ttl_s: int | None = None,
        shards: int = 0,
    ):
        """Jobs over ``max_prompt_bytes`` or ``max_n`` are refused at submit (workers check too).

        ``result_ttl_s``: how long a finished job's outputs stay readable (as
        RQ's ``result_ttl``); None leaves it to the workers' ``--result-ttl``.
        ``shards``: the pool's shard count on a Redis Cluster (``lifecycle.keys``), the
        same as its workers'; 0 (default) for one standalone Redis.
        """
        self.limits = JobLimits(max_prompt_bytes, max_n)
        self.result_ttl_s = result_ttl_s
        if isinstance(connection, str):
            connection = connect_async(connection)
        self.redis = connection
        self.keys = Keys(prefix, shards)
        self._submit = Submit(self.redis, self.keys)
        self.follower = Follower(self.redis, self.keys)

    async def resolve(
        self, requested: LoRARequest | AdapterRecord | str | None
    ) -> LoRARequest | None:
        """The LoRARequest to enqueue for an adapter's name or LoRARequest, checked against
        its registry record (UnknownAdapter, a ValueError, when it has none). A record the
        caller has just read (the gateway's model look-up) is taken as it is: no second
        read of the registry for the same request."""
        if requested is None:
            return None
        if isinstance(requested, AdapterRecord):
            return lora_from_record(requested)
        name = requested_name(requested)
        record = decode_adapter_record(await self.redis.hget(self.keys.adapters, name))
        return check_lora(requested, record)

    async def submit(
        self,
        prompt: str | dict[str, Any],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | str | None = None,
        request_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        priority: str = "interactive",
        on_finish: str | None = None,
    ) -> AsyncJobHandle:
        """Enqueue one job (see ``Producer.submit``)."""
        handles = await self.submit_many(
            [prompt], params, [lora_request], [request_id], metadata, priority, on_finish
        )
        return handles[0]

    async def submit_many(
        self,
        prompts: Sequence[str | dict[str, Any]],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora_request: LoRARequest | AdapterRecord | str | None | list = None,
        request_ids: list[str | None] | None = None,
        metadata: dict[str, Any] | None = None,
        priority: str = "interactive",
        on_finish: str | None = None,
    ) -> list[AsyncJobHandle]:
        """Enqueue several jobs in one round trip, all validated first."""
        self.keys.on(0).stream(priority)  # an unknown priority fails before anything is sent
        callback = check_on_finish(on_finish)
        count = len(prompts)
        unique, at = distinct(per_prompt(lora_request, count, "adapters"))
        resolved = [await self.resolve(x) for x in unique]
        loras = [resolved[i] for i in at]
        jobs = [
            build_job(p, sp, lora, rid, metadata, self.limits, self.result_ttl_s)
            for p, sp, lora, rid in zip(
                prompts, per_prompt(params, count, "params"), loras, request_ids or [None] * count
            )
        ]
        entries = await self._submit(jobs, priority, callback)
        handles = []
        for job, entry in zip(jobs, entries):
            handle = (
                AsyncJobHandle(self, job.request_id, job.sampling_params.output_kind)
                if entry
                else await self.handle(job.request_id)
            )
            handle.enqueued = bool(entry)
            handles.append(handle)
        return handles

    async def handle(self, request_id: str) -> AsyncJobHandle:
        kind = await self.redis.hget(self.keys.job(request_id), "output_kind")
        return AsyncJobHandle(self, request_id, kind.decode() if kind else "cumulative")

    async def abort(self, request_id: str) -> None:
        await marker.abort(self.redis, self.keys, request_id)

    async def aclose(self) -> None:
        await self.follower.close()
        await self.redis.aclose()
