"""The gateway's way into the pool: model names, submission and Redis being away.

One ``Pool`` per process, made at startup: an ``AsyncProducer`` (submits, handles)
and a ``PoolView`` (reads) on one connection. Every Redis call of a request goes
through here or through a handle it returned. It is pool access only: it answers with
facts (a record, a count, a rate window's state, None) and raises the pool's own
exceptions (``JobLost``, ``NoWorker``, TimeoutError, Redis away). What OpenAI's API makes
of a request (parsing, bounds, rate limits, the backlog bound, webhooks, every
refusal's wording) is ``lorapool.openai.serving``'s, which reaches the pool through
``PoolAccess``, the part of this class it needs; it names nothing of ``lorapool.openai``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from redis.exceptions import ResponseError

from lorapool.connection import REDIS_DOWN, connect, connect_async
from lorapool.gateway import resolver
from lorapool.gateway.config import GatewayConfig
from lorapool.gateway.dashboard_session import Sessions
from lorapool.gateway.heavy import HeavyWork
from lorapool.gateway.pool_view import PoolView
from lorapool.gateway.redis_watch import RedisWatch, until_outage
from lorapool.gateway.streams import merged_chunks, until_taken
from lorapool.gateway.tokenizer import TokenizerCache
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.lifecycle.marker import NoWorker
from lorapool.lifecycle.queue_position import QueuePosition
from lorapool.lifecycle.rate_limits import RateLimiter, RateState
from lorapool.producer import AsyncJobHandle, AsyncProducer, JobLost
from lorapool.producer.registry import AdapterRegistry
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.records.adapter import AdapterRecord, ModelIdentity
from lorapool.records.chunk import Chunk
from lorapool.tasks import cancel_and_wait

logger = logging.getLogger(__name__)
BASE_TTL_S = 5.0  # the base model changes only when the pool is rebuilt


class Pool:
    """The pool as the gateway's routes see it."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        connection = _connect(config)
        self.producer = AsyncProducer(
            connection, config.prefix, config.max_prompt_bytes, config.max_n, shards=config.shards
        )
        self.view = PoolView(self.producer)
        self.position = QueuePosition(self.producer.redis, self.producer.keys)
        self.tokenizers = TokenizerCache()
        self.rates = RateLimiter(self.producer.redis, self.producer.keys)
        self.watch = RedisWatch(config.redis_url, config.retry_after_s)
        self.sessions = Sessions(self.producer.redis, self.producer.keys, config.session_ttl_s)
        self.heavy = HeavyWork(config.grammar_limits, config.heavy_workers)
        self._registry: AdapterRegistry | None = None
        self._base: tuple[float, ModelIdentity | None] = (0.0, None)

    async def ensure_groups(self) -> None:
        """The ``workers`` group of every job stream, made when missing (XGROUP CREATE
        MKSTREAM, as a worker makes it): KEDA's pending count (deploy/autoscale/keda/)
        fails on a stream without it, and a pool scaled to zero has no worker to make it.
        Redis away or refusing: logged; the first worker makes them then."""
        redis = self.producer.redis
        try:
            views = self.producer.keys.shard_views
            for stream in (stream for view in views for stream in view.streams):
                try:
                    await redis.xgroup_create(stream, WORKERS_GROUP, id="0", mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
        except (*REDIS_DOWN, ResponseError) as exc:
            logger.warning("gateway: could not create the consumer groups (%s)", exc)

    async def close(self) -> None:
        self.heavy.close()
        await self.watch.close()
        await self.producer.aclose()
        if self._registry is not None:
            self._registry.redis.close()

    def sync_registry(self) -> AdapterRegistry:
        """The registry with its own synchronous client, for adapter administration
        (registering reads the weights: callers run it in a thread)."""
        if self._registry is None:
            config = self.config
            connection = connect(config.redis_url, config.redis_retries, **config.redis_options())
            roots = list(self.config.adapter_roots) or None
            self._registry = AdapterRegistry(connection, self.producer.keys, roots)
        return self._registry

    async def base_model(self) -> ModelIdentity | None:
        """The base model's identity, read at most every BASE_TTL_S."""
        taken, record = self._base
        if record is None or time.monotonic() - taken > BASE_TTL_S:
            record = await self.view.base_model()
            self._base = (time.monotonic(), record)
        return record

    async def adapter(self, name: str) -> AdapterRecord | None:
        """The registry record of adapter ``name`` as read now, which ``enqueue`` takes
        without reading it again; an unregistered name is tried under the adapter roots
        (``resolver.py``); None: neither has it."""
        return await self.view.adapter(name) or await resolver.resolve(self, name)

    async def live_workers(self):
        return await self.view.live_workers()

    async def backlog(self) -> int:
        return await self.view.backlog()

    async def has_webhook_secret(self, tenant: str) -> bool:
        return await self.view.has_webhook_secret(tenant)

    async def take_rate(
        self,
        tenant: str | None,
        rpm: int | None,
        tpm: int | None,
        requests: int,
        tokens: int,
        dry: bool = False,
    ) -> RateState:
        """``requests`` and ``tokens`` taken from ``tenant``'s minute, or not (GCRA:
        ``lifecycle.rate_limits``; ``dry``: only whether they would be)."""
        return await self.rates.take(tenant, rpm, tpm, requests, tokens, dry)

    async def compile_grammar(self, constraint) -> None:
        """``constraint`` compiled in the grammar sandbox, off the loop (``heavy.py``):
        FieldError naming the limit or the problem when it does not."""
        await self.heavy.compile(constraint)

    async def decoder(self):
        """The pool's tokenizer's ``decode`` (None before a worker published it)."""
        tokenizer = await self.tokenizers.get(self.producer.redis, self.producer.keys.tokenizer)
        return None if tokenizer is None else tokenizer.decode

    async def enqueue(
        self,
        prompts: list[Any],
        params: SamplingParams,
        lora: AdapterRecord | LoRARequest | None,
        request_ids: list[str],
        metadata: dict[str, Any] | None,
        priority: str = "interactive",
        on_finish: str | None = None,
    ) -> list[AsyncJobHandle]:
        """One job per prompt; the job boundary's FieldError, UnknownAdapter or
        ValueError as raised."""
        return await self.producer.submit_many(
            prompts, params, lora, request_ids, metadata, priority, on_finish
        )

    async def chunks(self, handles: list[AsyncJobHandle]) -> AsyncIterator[tuple[int, Chunk]]:
        """(handle index, chunk) of the jobs as they come (``streams.merged_chunks``);
        NoWorker while no worker has taken them (they are then kept queued),
        RedisAway once Redis has been away ``redis_outage_s``, JobLost once
        a job's state has left Redis."""
        kept: set[str] = set()
        watch = asyncio.ensure_future(_keeping(self.untaken(handles), kept, handles))
        chunks = until_taken(merged_chunks(handles, kept), watch)
        items = until_outage(chunks, self.watch, self.config.redis_outage_s)
        async with aclosing(items):  # closed when the reader leaves, not by the finalizer
            async for item in items:
                yield item

    async def handle(self, request_id: str) -> AsyncJobHandle:
        return await self.producer.handle(request_id)

    async def results(
        self, handles: list[AsyncJobHandle], timeout_s: float, gone=None
    ) -> list | None:
        """The final RequestOutput of each handle; TimeoutError (the jobs aborted) past
        ``timeout_s``, NoWorker (the jobs kept queued) while no worker has taken a job
        after ``queue_timeout_s``, JobLost (the others aborted) once a job's marker and
        log have left Redis (found at the next poll of its log: within seconds),
        RedisAway (the jobs left as they are) once Redis has been away
        ``redis_outage_s``. ``gone``: an awaitable that returns once the client has left;
        its jobs are then aborted (no one will read them) and the answer is None."""
        waiting = asyncio.ensure_future(
            asyncio.gather(*(h.result(timeout=timeout_s) for h in handles))
        )
        watching = asyncio.ensure_future(gone) if gone is not None else None
        untaken = asyncio.ensure_future(self.untaken(handles))
        outage = self.watch.when_away(self.config.redis_outage_s)
        try:
            await asyncio.wait({waiting, untaken, outage} | ({watching} if watching else set()),
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if outage.done() and not waiting.done():
                waiting.cancel()  # the jobs are not aborted: Redis cannot be told
                waiting.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise self.watch.unavailable(self.config.redis_outage_s)
            if untaken.done():
                await cancel_and_wait(waiting)
                untaken.result()  # raises NoWorker
            if not waiting.done():
                await cancel_and_wait(waiting)
                await _abort(handles)
                return None
            return waiting.result()
        except (JobLost, TimeoutError):  # lost: the call's other jobs are aborted
            await _abort(handles)
            raise
        finally:
            untaken.cancel()
            self.watch.forget(outage)
            if watching is not None:
                watching.cancel()

    async def untaken(self, handles: list[AsyncJobHandle]) -> None:
        """Raises NoWorker when, ``queue_timeout_s`` after it starts, a job of ``handles``
        still waits for a worker to take it (the job stays queued, for the worker a
        scale-up brings: ``GET /v1/jobs/{id}``). Otherwise never returns."""
        await asyncio.sleep(self.config.queue_timeout_s)
        waiting = [h.request_id for h in handles if await self._waiting(h.request_id)]
        if waiting:
            raise NoWorker(waiting, self.config.queue_timeout_s)
        await asyncio.Future()  # every job taken: nothing to say

    async def _waiting(self, request_id: str) -> bool:
        """Whether no worker has taken the job yet: it waits in the stream (its queue
        position is known), or nothing of it has begun and no worker lives."""
        if await self.position(request_id) is not None:
            return True
        state = await self.view.job_state(request_id)
        return state is not None and not state["started"] and not await self.view.live_workers()


def _connect(config: GatewayConfig):
    """A client whose pool waits for a free connection (up to ``redis_connections``):
    redis-py's default pool fails a call past 100 connections in use ("Too many
    connections", a 503), which a burst of a few hundred open streams reaches. The wait
    has no bound of its own: a wait bounded by the call's timeout answered a burst of
    512 streams on a loaded machine with 503 "the queue is unreachable: No connection
    available" while Redis answered (`lorapool bench gateway`); a request waiting
    while Redis stalls gets its 503 from the edge once the watch notices (edge.py)."""
    return connect_async(
        config.redis_url,
        config.redis_retries,
        max_connections=config.redis_connections,
        **config.redis_options(),
    )


async def _abort(handles: list[AsyncJobHandle]) -> None:
    for handle in handles:
        await handle.abort()


async def _keeping(untaken, kept: set[str], handles: list) -> None:
    """``untaken``; when it raises (no worker came), the jobs go into ``kept`` first,
    so that closing their streams leaves them queued."""
    try:
        await untaken
    except NoWorker:
        kept.update(h.request_id for h in handles)
        raise


async def disconnected(request, every_s: float = 0.5) -> None:
    """Returns once the HTTP client of ``request`` has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(every_s)
