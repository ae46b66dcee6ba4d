"""An OpenAI request body as lorapool's job fields: prompts, SamplingParams, metadata.

The body is parsed by its Struct (``bodies``: an unknown parameter, a wrong type or a
value out of its bounds is a 400 naming it); what the types cannot say is checked by
the job boundary (``SamplingParams`` and ``wire.job_from_dict``), so HTTP and Python
clients meet one check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import msgspec
from msgspec import UNSET

from lorapool.egress import EgressRefused, split_url
from lorapool.lifecycle.submit import check_on_finish
from lorapool.openai.bodies import (
    IGNORED,
    Chat,
    ChatJob,
    ChatRequest,
    CompletionJob,
    CompletionRequest,
    JobKind,
    parse,
)
from lorapool.openai.errors import APIError, bad_request, field_error
from lorapool.openai.legacy import legacy_functions
from lorapool.openai.structured import structured_of
from lorapool.openai.tools import ToolRequest, tools_of
from lorapool.protocol import FieldError, SamplingParams, short_repr

# request parameters that are SamplingParams fields of the same name
SAMPLING = (
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "spaces_between_special_tokens",
    "logit_bias",
    "prompt_logprobs",
)
_SAMPLED = attrgetter(*SAMPLING)
LEGACY_NAMES = {
    "tools": "functions",
    "tool_choice": "function_call",
}  # the values of a request's SAMPLING, in one call


@dataclass
class Parsed:
    """What one OpenAI request asks for."""

    model: str
    prompts: list[Any]  # each a str, {"prompt_token_ids": [...]} or {"messages": [...]}
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # job field -> request parameter
    tools: ToolRequest | None = None
    priority: str = "interactive"  # the pool's stream (``stream_of``)
    echo: bool = False  # completions: the prompt before each choice's text
    ignored: list[str] = field(default_factory=list)  # parameters accepted and dropped


def _parsed(request: CompletionRequest | ChatRequest, prompts: list[Any], params) -> Parsed:
    options = request.stream_options
    metadata = {} if request.user is None else {"user": request.user}
    usage = options is not None and options.include_usage
    return Parsed(request.model, prompts, params, bool(request.stream), usage, metadata,
                  priority=stream_of(request.priority), ignored=ignored_of(request))  # fmt: skip


_IGNORED = attrgetter(*IGNORED)
# the reply's header naming the parameters a request gave that were accepted and dropped
IGNORED_HEADER = "X-Lorapool-Ignored-Params"
_MAX_SHOWN = 16


def ignored_header(names: list[str]) -> dict[str, str]:
    """``IGNORED_HEADER`` naming ``names`` (none: no header): each escaped to printable
    ASCII and cut to 64 characters, the first 16 of them."""
    if not names:
        return {}
    shown = [n.encode("unicode_escape").decode("ascii")[:64] for n in names[:_MAX_SHOWN]]
    more = len(names) - len(shown)
    return {IGNORED_HEADER: ", ".join(shown) + (f" (and {more} more)" if more > 0 else "")}


def ignored_of(request: CompletionRequest | ChatRequest) -> list[str]:
    """The parameters of ``IGNORED`` that ``request`` gives (not null)."""
    values = _IGNORED(request)
    if values.count(None) == len(IGNORED):  # (most requests: at once)
        return []
    return [name for name, value in zip(IGNORED, values) if value is not None]


def _sampling(request, extra: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    values = {name: v for name, v in zip(SAMPLING, _SAMPLED(request)) if v is not None}
    values.update(extra)
    constraint, name = structured_of(request)
    if constraint is not None and "structured_outputs" in values:
        raise bad_request(
            f"{name} cannot be combined with tool_choice="
            f"{msgspec.to_builtins(request.tool_choice)!r}",
            name,
        )
    if constraint is not None:
        values["structured_outputs"] = constraint
        names["structured_outputs"] = name
    try:
        return SamplingParams(**values)
    except FieldError as exc:
        raise field_error(exc, names=names) from None


def stream_of(priority: int | None) -> str:
    """vLLM's per-request ``priority`` (an integer, lower first, 0 by default) on the
    pool's two streams: above 0 the batch stream (read by workers with the capacity
    interactive jobs leave), else the interactive one."""
    return "batch" if priority is not None and priority > 0 else "interactive"


def parse_completion(body: Any, max_prompts: int, drop_unknown: bool = True) -> Parsed:
    """POST /v1/completions: prompt (a string, token ids, or a batch of either);
    ``body``: the JSON bytes, or their value. ``drop_unknown``: a field no route knows
    is dropped and named in ``Parsed.ignored`` (else a 400: a batch line's, which has no
    reply to name it in)."""
    unknown: list[str] | None = [] if drop_unknown else None
    parsed = _completion(parse(body, CompletionRequest, unknown), max_prompts)
    parsed.ignored += unknown or []
    return parsed


def _completion(request: CompletionRequest, max_prompts: int) -> Parsed:
    prompts = _prompts(request.prompt, max_prompts)
    logprobs, asked = request.logprobs, request.prompt_logprobs
    extra = {} if logprobs is None else {"logprobs": logprobs}
    if request.echo and logprobs is not None:  # the prompt's tokens get logprobs too
        extra["prompt_logprobs"] = logprobs if asked is None else max(logprobs, asked)
    names: dict[str, str] = {}
    parsed = _parsed(request, prompts, _sampling(request, extra, names))
    parsed.echo, parsed.names = bool(request.echo), names
    return parsed


def _prompts(prompt: str | list, max_prompts: int) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    if 0 < len(prompt) <= max_prompts and not any(isinstance(p, int) for p in prompt):
        return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]
    raise bad_request(
        "prompt must be a string, a list of token ids, or a list of 1 to "
        f"{max_prompts} of either, got {short_repr(prompt)}",
        "prompt",
    )


def parse_chat(
    body: Any, tool_parser: str = "hermes", max_bytes: int = 1 << 20, drop_unknown: bool = True
) -> Parsed:
    """POST /v1/chat/completions: messages (and tools), the template applied by the
    worker; ``tool_parser``: the family parser of ``tool_choice="auto"`` replies;
    ``drop_unknown`` as ``parse_completion``'s."""
    unknown: list[str] | None = [] if drop_unknown else None
    parsed = _chat(parse(body, ChatRequest, unknown), tool_parser, max_bytes)
    parsed.ignored += unknown or []
    return parsed


def chat_parsed(request: ChatRequest, tool_parser: str, max_bytes: int) -> Parsed:
    """A chat body already parsed (``bodies.ChatRequest``: the Responses API's chat)."""
    return _chat(request, tool_parser, max_bytes)


def _chat(request: ChatRequest, tool_parser: str = "hermes", max_bytes: int = 1 << 20) -> Parsed:
    names = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}
    extra = _chat_logprobs(request)
    if request.max_completion_tokens is not None:
        extra["max_tokens"] = request.max_completion_tokens
    else:
        names.pop("max_tokens")
        if request.max_tokens is None:
            extra["max_tokens"] = None  # OpenAI's chat default: up to the context length
    legacy = request.functions is not None
    request = legacy_functions(request)
    try:
        tools = tools_of(request, max_bytes, tool_parser)
    except APIError as exc:  # named as the request named it
        if legacy:
            exc.param = LEGACY_NAMES.get(exc.param, exc.param)
            exc.message = exc.message.replace("tool_choice", "function_call")
        raise
    if tools is not None:
        tools.legacy = legacy
    if tools is not None and tools.constraint is not None:
        extra["structured_outputs"] = tools.constraint
    params = _sampling(request, extra, names)
    chat = {"messages": [m.to_job() for m in request.messages]}
    if tools:
        chat["tools"] = tools.tools
    parsed = _parsed(request, [chat], params)
    parsed.names, parsed.tools = names, tools
    return parsed


def _chat_logprobs(request: ChatRequest) -> dict[str, Any]:
    top = request.top_logprobs
    if top is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    return {"logprobs": 0 if top is None else top} if request.logprobs else {}


def chat_messages(body: Any) -> list[dict[str, Any]]:
    """A body's ``messages`` as a chat job carries them (its other fields not read)."""
    return [m.to_job() for m in parse(body, Chat).messages]


def parse_job(body: Any) -> tuple[Parsed, str | None, str | None]:
    """POST /v1/jobs: one prompt (as /v1/completions) or one chat (as /v1/chat/completions),
    and optionally the client's own ``request_id`` and an ``on_finish`` webhook URL."""
    kind = _job_kind(body)
    if kind.stream is not UNSET:
        raise bad_request("a job streams through GET /v1/jobs/{id}/events", "stream")
    unknown: list[str] = []
    if kind.messages is not UNSET:
        request = parse(body, ChatJob, unknown)
        parsed = _chat(request)
    else:
        request = parse(body, CompletionJob, unknown)
        parsed = _completion(request, 1)
    parsed.ignored += unknown
    if len(parsed.prompts) != 1:
        raise bad_request("a job has one prompt", "prompt")
    return parsed, request.request_id, _webhook(request.on_finish)


def _job_kind(body: Any) -> JobKind:
    if isinstance(body, dict):
        return JobKind(**{k: body[k] for k in ("messages", "stream") if k in body})
    try:
        return parse(body, JobKind)
    except APIError:  # not an object: told by the parse of a completion job
        return JobKind()


def _webhook(value: str | None) -> str | None:
    """A job's ``on_finish`` over HTTP: an http(s) URL only (a dotted function path would
    have the web app's RQ workers run a function an HTTP client named), whose form the
    egress module accepts; where it points is checked by ``OpenAIServing.check_webhook``."""
    if value is None:
        return None
    try:
        url = check_on_finish(value)
        split_url(url)
    except (FieldError, EgressRefused) as exc:
        raise bad_request(f"on_finish: {exc}", "on_finish") from None
    return url
