"""OpenAI's API served over a pool: one object owning a request's way from its body to
its reply, for every door that takes OpenAI requests (the gateway's routes, batch).

    parse -> resolve -> limits -> [hold] -> rate -> grammar -> backlog -> submit -> shape
          -> reply (the whole response) | events (its stream chunks)

What it needs of the pool is ``PoolAccess`` (``gateway.pool.Pool`` is one): facts, on
which the policy of ``admission`` (model names, rate limits, the backlog bound,
webhooks, a wait without a result) decides here. What it needs of the door that took
one request (its stream's hold, where a rate check's headers go) is ``Door``; of its
caller (a key's tenant, limits and ids), ``Caller``. The steps are methods,
so a door with its own order (``/v1/jobs`` checks a webhook between them) uses them
one by one; ``submit`` runs them in the order above. The pure parts (``parse``,
``shape_of``, ``answer``) need no pool: batch lines are parsed and answered by them.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from lorapool.lifecycle.marker import JobLost, NoWorker, RedisAway
from lorapool.lifecycle.rate_limits import RateState
from lorapool.openai import admission
from lorapool.openai.echo import Echo
from lorapool.openai.errors import APIError, field_error, model_not_found
from lorapool.openai.format import Shape, fingerprint
from lorapool.openai.limits import LimitsCache, PoolLimits, check_limits, check_stop_count
from lorapool.openai.params import Parsed, ignored_header, parse_chat, parse_completion
from lorapool.openai.structured import grammar_error
from lorapool.outputs import RequestOutput
from lorapool.protocol import FieldError, LoRARequest, SamplingParams
from lorapool.records.adapter import AdapterRecord, ModelIdentity, UnknownAdapter
from lorapool.records.chunk import Chunk
from lorapool.tool_calls import parser_for

KINDS = ("completion", "chat")  # a request's kind: the shape of its reply


class Caller(Protocol):
    """Who sent a request (``gateway.auth.Principal``): its tenant and rate limits, the
    models it may use, its jobs' ids and metadata."""

    tenant: str | None
    rpm: int | None
    tpm: int | None

    def may_use(self, model: str) -> bool: ...
    def job_id(self, external: str) -> str: ...
    def external_id(self, request_id: str) -> str: ...
    def job_metadata(self, given: dict[str, Any]) -> dict[str, Any]: ...


class Handle(Protocol):
    """A submitted job (``producer.AsyncJobHandle``)."""

    request_id: str


class PoolAccess(Protocol):
    """What serving OpenAI's API needs of a pool: facts (None: no such record). Its
    exceptions are the pool's (``enqueue``'s the job boundary's; a wait's ``NoWorker``,
    ``JobLost``, ``RedisAway``, TimeoutError), translated here (``admission``)."""

    async def base_model(self) -> ModelIdentity | None: ...
    async def adapter(self, name: str) -> AdapterRecord | None: ...
    async def live_workers(self) -> list[Any]: ...  # heartbeats: the pool's limits
    async def backlog(self) -> int: ...
    async def has_webhook_secret(self, tenant: str) -> bool: ...
    async def take_rate(
        self,
        tenant: str | None,
        rpm: int | None,
        tpm: int | None,
        requests: int,
        tokens: int,
        dry: bool = False,
    ) -> RateState: ...
    async def compile_grammar(self, constraint: Any) -> None: ...  # FieldError: refused
    async def decoder(self) -> Callable[[list[int]], str] | None: ...

    async def enqueue(
        self,
        prompts: list[Any],
        params: SamplingParams,
        lora: AdapterRecord | LoRARequest | None,
        request_ids: list[str],
        metadata: dict[str, Any] | None,
        priority: str,
        on_finish: str | None,
    ) -> list[Any]: ...  # FieldError, UnknownAdapter, ValueError: refused

    async def results(
        self, handles: list[Any], timeout_s: float, gone: Awaitable | None
    ) -> list[RequestOutput] | None: ...  # None: the client left (``gone``), jobs aborted

    def chunks(self, handles: list[Any]) -> AsyncIterator[tuple[int, Chunk]]: ...


class Hold(Protocol):
    def release(self) -> None: ...


class Door(Protocol):
    """The side of one request that its door owns: a stream's hold on the door's
    capacity, taken before the rate check, and where the rate check's
    ``x-ratelimit-*`` headers go."""

    def hold(self) -> Hold: ...
    def rated(self, headers: dict[str, str]) -> None: ...


@dataclass(frozen=True)
class ServingConfig:
    """The door's bounds on what a request may ask and how long its reply is waited
    for (``GatewayConfig``'s, whose defaults these are)."""

    max_prompts: int = 128
    max_prompt_bytes: int = 1 << 20
    max_stop: int = 4
    tool_call_parser: str = "auto"
    max_backlog: int | None = None  # waiting jobs at which submits get 429
    retry_after_s: int = 1  # a 429's or 503's Retry-After
    result_timeout_s: float = 600.0  # then 504, the jobs aborted
    webhook_allow: tuple[str, ...] = ()  # internal networks a webhook may name


@dataclass
class Submitted:
    """A request's jobs, the shape of its reply, and its stream's hold (None: a call
    that waits for the whole reply)."""

    parsed: Parsed
    handles: list[Any]
    shape: Shape
    hold: Hold | None = None


def parse(kind: str, body: Any, config: ServingConfig, tool_parser: str, drop_unknown=True):
    """The request ``body`` of ``kind`` (``KINDS``) as a ``Parsed``; 400 naming the field."""
    if kind == "chat":
        return parse_chat(body, tool_parser, config.max_prompt_bytes, drop_unknown)
    return parse_completion(body, config.max_prompts, drop_unknown)


def shape_of(
    kind: str,
    parsed: Parsed,
    public_id: str,
    public=None,
    base: ModelIdentity | None = None,
    echo: Echo | None = None,
    named: bool = True,
) -> Shape:
    """The Shape of a reply to ``parsed``: ``public_id`` its id (after ``cmpl-``),
    ``public`` a job's request id -> its client's, ``base`` the base model;
    ``named``: a failed job's error names the request's parameter (chat's
    ``top_logprobs``), not the job's field (a batch line's error file did not)."""
    params, names = parsed.params, parsed.names if named else None
    return Shape(kind, public_id, parsed.model, params.n, params.logprobs or 0, public, names,
                 tools=parsed.tools, system_fingerprint=fingerprint(base), echo=echo)  # fmt: skip


def echo_of(parsed: Parsed, decode: Callable[[list[int]], str] | None = None) -> Echo | None:
    """Completions' echo of ``parsed`` (None: off); ``decode`` turns a prompt of token
    ids back into text (None: it is echoed as the worker's prompt text)."""
    return Echo(decode, parsed.params.logprobs or 0) if parsed.echo else None


def answer(shape: Shape, outputs: list[RequestOutput]) -> tuple[dict[str, Any], int]:
    """The reply's body and HTTP status: the response, or the error a failed job got."""
    try:
        return shape.response(outputs), 200
    except APIError as exc:
        return exc.body(), exc.status


def submit_error(exc: Exception, request_id: str | None, names) -> APIError:
    """The APIError of a job the job boundary refused (``PoolAccess.enqueue``'s, or a
    batch line's checked job ``request_id``): 400 naming the request's parameter."""
    if isinstance(exc, FieldError):
        return field_error(exc, request_id or exc.request_id, names)
    if isinstance(exc, UnknownAdapter):  # the adapter left the registry meanwhile
        return model_not_found(exc.name)
    return APIError(400, str(exc))


class OpenAIServing:
    """OpenAI's completions and chat completions over ``pool``."""

    def __init__(self, pool: PoolAccess, config: ServingConfig):
        self.pool, self.config = pool, config
        self.limits = LimitsCache()

    async def tool_parser(self) -> str:
        """The tool-call parser of ``tool_choice="auto"`` replies: the configured one, else
        the base model's family's (``lorapool.tool_calls.parser_for``)."""
        if self.config.tool_call_parser != "auto":
            return self.config.tool_call_parser
        base = await self.pool.base_model()
        return parser_for(base.name if base else None)

    @staticmethod
    def reply_headers(parsed: Parsed) -> dict[str, str]:
        """The reply's headers: the parameters accepted and ignored (``IGNORED_HEADER``)."""
        return ignored_header(parsed.ignored)

    async def parse(self, kind: str, body: Any) -> Parsed:
        parser = await self.tool_parser() if kind == "chat" else "hermes"
        return parse(kind, body, self.config, parser)

    async def prepare(self, parsed: Parsed, caller: Caller) -> AdapterRecord | None:
        """The adapter ``parsed`` names (None: the base model), once its parameters are
        within the pool's bounds: 404 for a model the caller may not use, else 400
        naming the parameter."""
        lora = await self.resolve(parsed.model, caller)
        check_stop_count(parsed, self.config.max_stop)
        check_limits(parsed, await self.pool_limits())
        return lora

    async def resolve(self, model: str, caller: Caller) -> AdapterRecord | None:
        """The registry record of the adapter ``model`` names (None: the base model, whose
        name is the pool's cached one); 404 ``model_not_found`` for none the caller may
        use, 400 for a name no model can have."""
        base = await self.pool.base_model()
        if base is not None and model == base.name:
            return None
        admission.check_model_name(model)
        record = await self.pool.adapter(model) if caller.may_use(model) else None
        if record is None:
            raise model_not_found(model)
        return record

    async def pool_limits(self) -> PoolLimits:
        """The bounds the pool's live workers hold requests to (``limits.py``)."""
        return await self.limits.get(self.pool)

    async def check_rate(
        self, caller: Caller, requests: int, params: SamplingParams | None
    ) -> dict[str, str] | None:
        """Take a submit of ``requests`` prompts from its tenant's requests and tokens per
        minute (``admission``): the ``x-ratelimit-*`` headers of its answer (None: the
        caller has no limits), 429 past them, 400 for a submit that could never fit."""
        if caller.rpm is None and caller.tpm is None:
            return None
        tokens = admission.rate_cost(caller, requests, params)
        state = await self.pool.take_rate(caller.tenant, caller.rpm, caller.tpm, requests, tokens)
        if not state.taken:
            raise admission.rate_refused(caller, state)
        return state.headers()

    async def check_room(self, caller: Caller) -> None:
        """429 (``check_rate``'s) when the caller's requests per minute has no room for
        one request, the least any submit takes: asked before its body is read; takes
        nothing (``check_rate`` does, from what the body says)."""
        if caller.rpm is None:
            return
        state = await self.pool.take_rate(caller.tenant, caller.rpm, caller.tpm, 1, 0, dry=True)
        if not state.taken:
            raise admission.rate_refused(caller, state)

    async def check_webhook(self, url: str, caller: Caller) -> None:
        """400 naming ``on_finish`` for a webhook URL that will not be called: an
        internal or unresolvable address (``admission.check_webhook_url``), or a tenant
        with no webhook secret to sign with."""
        await admission.check_webhook_url(url, self.config.webhook_allow)
        if not await self.pool.has_webhook_secret(caller.tenant or ""):
            raise admission.no_webhook_secret(caller.tenant)

    async def check_backlog(self) -> None:
        """429 ``backlog_full`` while ``max_backlog`` jobs wait for a worker."""
        bound = self.config.max_backlog
        if bound is not None and await self.pool.backlog() >= bound:
            raise admission.backlog_full(bound, self.config.retry_after_s)

    async def check_grammar(self, parsed: Parsed) -> None:
        """400 naming the parameter and the limit or problem when the structured output
        passes a ``GrammarLimits`` limit, does not compile, crashes the compiler or runs
        past its time (the pool compiles it in its sandbox); nothing when it has none."""
        constraint = parsed.params.structured_outputs
        if constraint is None:
            return
        try:
            await self.pool.compile_grammar(constraint)
        except FieldError as exc:
            message, param = grammar_error(exc, parsed)
            raise APIError(400, message, param) from None

    async def enqueue(
        self,
        parsed: Parsed,
        lora,
        caller: Caller,
        request_ids: list[str] | None = None,
        on_finish: str | None = None,
    ) -> list[Any]:
        """One job per prompt of ``parsed``, within the backlog bound; the job boundary's
        refusal as an APIError."""
        await self.check_backlog()
        ids = request_ids or [caller.job_id(uuid.uuid4().hex) for _ in parsed.prompts]
        metadata = caller.job_metadata(parsed.metadata) or None
        try:
            return await self.pool.enqueue(
                parsed.prompts, parsed.params, lora, ids, metadata, parsed.priority, on_finish
            )
        except (FieldError, UnknownAdapter, ValueError) as exc:
            raise submit_error(exc, None, parsed.names) from None

    async def submit(self, parsed: Parsed, kind: str, caller: Caller, door: Door) -> Submitted:
        """The jobs of ``parsed`` submitted and the Shape of their reply; a stream's hold
        (``door.hold``) is taken before the rate check and given back if a step fails."""
        lora = await self.prepare(parsed, caller)
        hold = door.hold() if parsed.stream else None
        try:
            headers = await self.check_rate(caller, len(parsed.prompts), parsed.params)
            if headers is not None:
                door.rated(headers)
            await self.check_grammar(parsed)  # compiled after the rate checks
            handles = await self.enqueue(parsed, lora, caller)
            public = caller.external_id(handles[0].request_id)
            base, echo = await self.pool.base_model(), await self._echo(parsed)
            shape = shape_of(kind, parsed, public, caller.external_id, base, echo)
        except BaseException:
            if hold is not None:
                hold.release()
            raise
        return Submitted(parsed, handles, shape, hold)

    async def _echo(self, parsed: Parsed) -> Echo | None:
        """Completions' echo; a prompt of token ids is decoded with the pool's tokenizer."""
        if not parsed.echo:
            return None
        decode = None
        if any(isinstance(p, dict) for p in parsed.prompts):
            decode = await self.pool.decoder()
        return echo_of(parsed, decode)

    async def reply(self, submitted: Submitted, caller: Caller, gone=None) -> dict[str, Any]:
        """The whole response, once every job has its final output (``gone``: returns
        once the client has left; its jobs are then aborted)."""
        try:
            outputs = await self.pool.results(submitted.handles, self.config.result_timeout_s, gone)
        except (NoWorker, JobLost, RedisAway, TimeoutError) as exc:
            raise self.wait_error(exc, caller) from None
        if outputs is None:
            raise admission.client_gone()
        return submitted.shape.response(outputs)

    def wait_error(self, exc: Exception, caller: Caller) -> APIError:
        config = self.config
        return admission.wait_error(exc, caller, config.retry_after_s, config.result_timeout_s)

    async def events(
        self, submitted: Submitted, caller: Caller, include_usage: bool | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """The jobs' chunks as OpenAI stream chunks; an error (typed as the same failure
        would be without streaming) ends them with an error object."""
        shape, handles = submitted.shape, submitted.handles
        if include_usage is None:
            include_usage = submitted.parsed.include_usage
        prompt_tokens = completion_tokens = cached = 0
        if shape.chat:
            for event in shape.role_chunks(range(len(handles) * shape.n), include_usage):
                yield event
        chunks = self.pool.chunks(handles)
        try:  # closed as the reader leaves: its follower unsubscribes then, not later
            async with aclosing(chunks):
                async for job, chunk in chunks:
                    shape.failed(chunk)
                    prompt_tokens += len(chunk.prompt_token_ids or ())
                    completion_tokens += chunk.num_tokens
                    cached += (chunk.metrics and chunk.metrics.num_cached_tokens) or 0
                    for event in shape.delta_chunks(job, chunk, include_usage):
                        yield event
        except APIError as exc:
            yield exc.body()
        except (NoWorker, JobLost, RedisAway) as exc:
            yield self.wait_error(exc, caller).body()
        else:
            if include_usage:
                yield shape.usage_chunk(prompt_tokens, completion_tokens, cached)
