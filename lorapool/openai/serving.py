"""OpenAI's API served over a pool: one object owning a request's way from its body to
its reply, for every door that takes OpenAI requests (the gateway's routes, batch).

    parse -> resolve -> limits -> [hold] -> rate -> grammar -> submit -> shape
          -> reply (the whole response) | events (its stream chunks)

What it needs of the pool is ``PoolAccess`` (``gateway.pool.Pool`` is one); what it
needs of the door that took one request (its stream's hold, its rate check) is
``Door``; of its caller (a key's tenant and ids), ``Caller``. The steps are methods,
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

from lorapool.openai.echo import Echo
from lorapool.openai.errors import APIError, field_error, model_not_found
from lorapool.openai.format import Shape, fingerprint
from lorapool.openai.limits import PoolLimits, check_limits, check_stop_count
from lorapool.openai.params import Parsed, parse_chat, parse_completion
from lorapool.openai.structured import grammar_error
from lorapool.outputs import RequestOutput
from lorapool.protocol import FieldError, LoRARequest, SamplingParams
from lorapool.records.adapter import AdapterRecord, ModelIdentity, UnknownAdapter
from lorapool.records.chunk import Chunk
from lorapool.tool_calls import parser_for

KINDS = ("completion", "chat")  # a request's kind: the shape of its reply


class Caller(Protocol):
    """Who sent a request (``gateway.auth.Principal``): its jobs' ids and metadata."""

    def job_id(self, external: str) -> str: ...
    def external_id(self, request_id: str) -> str: ...
    def job_metadata(self, given: dict[str, Any]) -> dict[str, Any]: ...


class Handle(Protocol):
    """A submitted job (``producer.AsyncJobHandle``)."""

    request_id: str


class PoolAccess(Protocol):
    """What serving OpenAI's API needs of a pool. Its errors are ``APIError``s (a
    backlog at its bound, a wait past its time, no worker, Redis away), except
    ``enqueue``'s, which are the job boundary's (translated here)."""

    async def base_model(self) -> ModelIdentity | None: ...
    async def resolve_model(self, model: str, caller: Any) -> AdapterRecord | None: ...
    async def pool_limits(self) -> PoolLimits: ...
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
        self, handles: list[Any], gone: Awaitable | None, caller: Any
    ) -> list[RequestOutput]: ...

    def chunks(self, handles: list[Any], caller: Any) -> AsyncIterator[tuple[int, Chunk]]: ...


class Hold(Protocol):
    def release(self) -> None: ...


class Door(Protocol):
    """The side of one request that its door owns: a stream's hold on the door's
    capacity, taken before the rate check, and the caller's rate limits."""

    def hold(self) -> Hold: ...
    async def check_rate(self, requests: int, params: SamplingParams | None) -> None: ...


@dataclass(frozen=True)
class ServingConfig:
    """The door's bounds on what a request may ask (``GatewayConfig``'s, whose defaults
    these are)."""

    max_prompts: int = 128
    max_prompt_bytes: int = 1 << 20
    max_stop: int = 4
    tool_call_parser: str = "auto"


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

    async def tool_parser(self) -> str:
        """The tool-call parser of ``tool_choice="auto"`` replies: the configured one, else
        the base model's family's (``lorapool.tool_calls.parser_for``)."""
        if self.config.tool_call_parser != "auto":
            return self.config.tool_call_parser
        base = await self.pool.base_model()
        return parser_for(base.name if base else None)

    async def parse(self, kind: str, body: Any) -> Parsed:
        parser = await self.tool_parser() if kind == "chat" else "hermes"
        return parse(kind, body, self.config, parser)

    async def prepare(self, parsed: Parsed, caller: Caller) -> AdapterRecord | None:
        """The adapter ``parsed`` names (None: the base model), once its parameters are
        within the pool's bounds: 404 for a model the caller may not use, else 400
        naming the parameter."""
        lora = await self.pool.resolve_model(parsed.model, caller)
        check_stop_count(parsed, self.config.max_stop)
        check_limits(parsed, await self.pool.pool_limits())
        return lora

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
        """One job per prompt of ``parsed``; the job boundary's refusal as an APIError."""
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
            await door.check_rate(len(parsed.prompts), parsed.params)
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
        outputs = await self.pool.results(submitted.handles, gone, caller)
        return submitted.shape.response(outputs)

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
        chunks = self.pool.chunks(handles, caller)
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
        else:
            if include_usage:
                yield shape.usage_chunk(prompt_tokens, completion_tokens, cached)
