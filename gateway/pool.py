"""The gateway's way into the pool: model names, submission and Redis being away.

One ``Pool`` per process, made at startup: an ``AsyncProducer`` (submits, handles)
and a ``PoolView`` (reads) on one connection. Every Redis call of a request goes
through here or through a handle it returned. It is pool access only: what OpenAI's
API makes of a request (parsing, bounds, the job boundary's refusals as the
request's parameters, reply shapes) is ``lorapool.openai.serving``'s, which reaches
the pool through ``PoolAccess``, the part of this class it needs.
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
from lorapool.egress import EgressError, EgressPolicy, EgressRefused, check_url, system_resolver
from lorapool.gateway import resolver
from lorapool.gateway.auth import OPEN, Principal
from lorapool.gateway.config import GatewayConfig
from lorapool.gateway.dashboard_session import Sessions
from lorapool.gateway.heavy import HeavyWork
from lorapool.gateway.pool_view import PoolView
from lorapool.gateway.redis_watch import RedisWatch, until_outage
from lorapool.gateway.streams import merged_chunks, until_taken
from lorapool.gateway.tokenizer import TokenizerCache
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.lifecycle.queue_position import QueuePosition
from lorapool.lifecycle.rate_limits import RateLimiter
from lorapool.openai.errors import APIError, job_lost, model_not_found
from lorapool.openai.limits import LimitsCache, PoolLimits
from lorapool.producer import AsyncJobHandle, AsyncProducer, JobLost
from lorapool.producer.registry import NAME_PATTERN, AdapterRegistry
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.records.adapter import AdapterRecord, ModelIdentity
from lorapool.records.chunk import Chunk
from lorapool.tasks import cancel_and_wait

logger = logging.getLogger(__name__)
BASE_TTL_S = 5.0  # the base model changes only when the pool is rebuilt

RESOLVE_S = 2.0  # a webhook host's resolution at submit, at most


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
        self.limits = LimitsCache()
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

    async def resolve_model(self, model: str, caller: Principal = OPEN) -> AdapterRecord | None:
        """The adapter ``model`` names, its registry record as read now, which ``submit``
        enqueues without reading it again (None: the base model), or 404 model_not_found
        (also for an adapter the caller's tenant may not use). An unregistered name is
        tried under the adapter roots (``resolver.py``). The base model's name is the
        cached one (``base_model``): a Redis read a request less."""
        base = await self.base_model()
        if base is not None and model == base.name:
            return None
        if not NAME_PATTERN.fullmatch(model):
            if "\x00" in model or len(model) > 1024:
                raise APIError(400, "model must be a model or adapter name", "model")
            raise model_not_found(model)
        if not caller.may_use(model):
            raise model_not_found(model)
        record = await self.view.adapter(model) or await resolver.resolve(self, model)
        if record is None:
            raise model_not_found(model)
        return record

    async def pool_limits(self) -> PoolLimits:
        """The bounds the pool's live workers hold requests to (``openai/limits.py``)."""
        return await self.limits.get(self.view)

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
        """One job per prompt, after the backlog check (429 at its bound); the job
        boundary's FieldError, UnknownAdapter or ValueError as raised."""
        await self.check_backlog()
        return await self.producer.submit_many(
            prompts, params, lora, request_ids, metadata, priority, on_finish
        )

    async def chunks(
        self, handles: list[AsyncJobHandle], caller: Principal = OPEN
    ) -> AsyncIterator[tuple[int, Chunk]]:
        """(handle index, chunk) of the jobs as they come (``streams.merged_chunks``);
        503 ``no_worker`` while no worker has taken them (they are then kept queued),
        503 ``redis_unavailable`` once Redis has been away ``redis_outage_s``, 503
        ``job_lost`` once a job's state has left Redis."""
        kept: set[str] = set()
        watch = asyncio.ensure_future(_keeping(self.untaken(handles, caller), kept, handles))
        chunks = until_taken(merged_chunks(handles, kept), watch)
        items = until_outage(chunks, self.watch, self.config.redis_outage_s)
        try:  # closed here when the reader leaves, not by the finalizer some time later
            async with aclosing(items):
                async for item in items:
                    yield item
        except JobLost as exc:  # its state left Redis: it will never finish
            raise job_lost(caller.external_id(exc.request_id)) from None

    async def check_backlog(self) -> None:
        """429 with Retry-After while ``max_backlog`` entries wait for a worker: a pool
        whose workers are stopped or saturated refuses work instead of piling it up."""
        bound = self.config.max_backlog
        if bound is not None and await self.view.backlog() >= bound:
            raise APIError(
                429,
                f"the pool's backlog is at its bound ({bound} waiting jobs); retry later",
                code="backlog_full",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )

    async def check_rate(
        self, caller: Principal, requests: int, params: SamplingParams | None, request=None
    ) -> None:
        """Take a submit from its tenant's requests and tokens per minute (tokens: the
        most it may generate, max_tokens x n a prompt; ``params`` None: a request that
        generates nothing, a file upload say): 429 with Retry-After and OpenAI's
        ``x-ratelimit-*`` headers past them; within them, the headers go on the answer
        (``request``'s state, added by the edge: ``edge.py``). A request that could never
        fit (more requests or tokens than the key's whole minute) is a 400: waiting would
        not help, so no Retry-After invites the client to try again."""
        if caller.rpm is None and caller.tpm is None:
            return
        if caller.rpm is not None and requests > caller.rpm:
            raise APIError(
                400,
                f"this request is {requests} requests (one a prompt), over this key's "
                f"{caller.rpm} requests per minute: it can never fit; send at most "
                f"{caller.rpm} prompts a request",
                "prompt",
                code="exceeds_rate_limit",
            )
        tokens = 0
        if params is not None:
            if caller.tpm is not None and params.max_tokens is None:
                raise APIError(400, "max_tokens is required under a token rate limit", "max_tokens")
            tokens = requests * params.n * (params.max_tokens or 0)
        if caller.tpm is not None and tokens > caller.tpm:
            raise APIError(
                400,
                f"this request may generate {tokens} tokens (max_tokens x n x prompts), over "
                f"this key's {caller.tpm} tokens per minute",
                "max_tokens",
            )
        state = await self.rates.take(caller.tenant, caller.rpm, caller.tpm, requests, tokens)
        if not state.taken:
            raise APIError(
                429,
                f"tenant {caller.tenant!r} is over its rate limit "
                f"({caller.rpm or '-'} requests, {caller.tpm or '-'} tokens a minute); "
                f"retry in {state.wait_s:.1f}s",
                code="rate_limit_exceeded",
                headers=state.headers(),
            )
        if request is not None:
            request.state.rate_headers = state.headers()

    async def check_webhook(self, url: str, caller: Principal) -> None:
        """400 naming ``on_finish`` for a webhook URL that will not be called: one that
        resolves to an internal address outside ``webhook_allow``, does not resolve (in
        ``RESOLVE_S``), or whose tenant has no webhook secret to sign with. The sender
        checks again at each attempt (a name may resolve elsewhere by then)."""
        policy = EgressPolicy(self.config.webhook_allow)
        try:
            await asyncio.wait_for(
                asyncio.to_thread(check_url, url, policy, system_resolver, RESOLVE_S),
                RESOLVE_S + 0.5,
            )
        except (EgressRefused, EgressError, asyncio.TimeoutError) as exc:
            reason = str(exc) or f"resolving took over {RESOLVE_S:g}s"
            raise APIError(400, f"on_finish: {reason}", "on_finish", "invalid_url") from None
        if not await self.view.has_webhook_secret(caller.tenant or ""):
            who = f"tenant {caller.tenant!r}" if caller.tenant else "this pool"
            raise APIError(
                400,
                f"on_finish: {who} has no webhook secret to sign deliveries with; "
                "the operator makes one with: lorapool keys webhook-secret "
                + (caller.tenant or ""),
                "on_finish",
            )

    async def handle(self, request_id: str) -> AsyncJobHandle:
        return await self.producer.handle(request_id)

    async def results(
        self, handles: list[AsyncJobHandle], gone=None, caller: Principal = OPEN
    ) -> list:
        """The final RequestOutput of each handle; 504 (and the jobs aborted) past the
        configured wait, 503 ``no_worker`` (the jobs kept queued) while no worker has
        taken a job after ``queue_timeout_s``, 503 ``job_lost`` once a job's marker and
        log have left Redis (found at the next poll of its log: within seconds).
        ``gone``: an awaitable that returns once the client has left; its jobs are then
        aborted (no one will read them)."""
        timeout = self.config.result_timeout_s
        waiting = asyncio.ensure_future(
            asyncio.gather(*(h.result(timeout=timeout) for h in handles))
        )
        watching = asyncio.ensure_future(gone) if gone is not None else None
        untaken = asyncio.ensure_future(self.untaken(handles, caller))
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
                untaken.result()  # raises no_worker
            if not waiting.done():
                await cancel_and_wait(waiting)
                await _abort(handles)
                raise APIError(499, "the client closed the request; its jobs were aborted")
            return waiting.result()
        except JobLost as exc:  # its state left Redis: the call's other jobs are aborted
            await _abort(handles)
            raise job_lost(caller.external_id(exc.request_id)) from None
        except (asyncio.TimeoutError, TimeoutError):
            await _abort(handles)
            raise APIError(504, f"no result within {timeout:g}s; the request was aborted") from None
        finally:
            untaken.cancel()
            self.watch.forget(outage)
            if watching is not None:
                watching.cancel()

    async def untaken(self, handles: list[AsyncJobHandle], caller: Principal = OPEN) -> None:
        """Raises 503 ``no_worker`` when, ``queue_timeout_s`` after it starts, a job of
        ``handles`` still waits for a worker to take it (the job stays queued, for the
        worker a scale-up brings: ``GET /v1/jobs/{id}``). Otherwise never returns."""
        await asyncio.sleep(self.config.queue_timeout_s)
        waiting = [h.request_id for h in handles if await self._waiting(h.request_id)]
        if waiting:
            ids = ", ".join(caller.external_id(rid) for rid in waiting)
            raise APIError(
                503,
                f"no worker took the request within {self.config.queue_timeout_s:g}s; "
                f"it stays queued as job {ids} (GET /v1/jobs/{{id}})",
                code="no_worker",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
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
    except APIError:
        kept.update(h.request_id for h in handles)
        raise


async def disconnected(request, every_s: float = 0.5) -> None:
    """Returns once the HTTP client of ``request`` has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(every_s)
