"""An OpenAI request body as lorapool's job fields: prompts, SamplingParams, metadata.

Only the parameters listed here are accepted (an unknown one is a 400 naming it);
their types and ranges are checked by the job boundary (``SamplingParams`` and
``wire.job_from_dict``), never here, so HTTP and Python clients meet one check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorapool.egress import EgressRefused, split_url
from lorapool.lifecycle.submit import check_on_finish
from lorapool.openai.errors import bad_request, field_error
from lorapool.openai.limits import check_seed
from lorapool.openai.structured import PARAMETERS as STRUCTURED
from lorapool.openai.structured import structured_of
from lorapool.openai.tools import PARAMETERS as TOOLS
from lorapool.openai.tools import ToolRequest, tools_of
from lorapool.protocol import FieldError, SamplingParams, short_repr

# request parameter -> SamplingParams field, the same name unless said
SAMPLING = {
    name: name
    for name in (
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
}
COMMON = {"model", "stream", "stream_options", "user", "priority"}
# accepted when null or at their default, refused otherwise (naming them)
INERT = {"best_of": None, "suffix": None}
COMPLETIONS = COMMON | set(SAMPLING) | STRUCTURED | {"prompt", "logprobs", "echo"}
CHAT = COMMON | set(SAMPLING) | STRUCTURED | TOOLS
CHAT |= {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
MAX_USER = 256
# fields of a reply's message that a client sends back as they were (openai's
# ``messages.append(completion.choices[0].message)``): dropped, they do not reach the model
ECHOED = {"refusal", "annotations", "audio", "function_call", "reasoning_content"}


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


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {short_repr(body)}", None)
    return body


def _check_known(body: dict[str, Any], known: set[str]) -> None:
    for name, value in body.items():
        if name in INERT:
            if value != INERT[name] and value is not None:
                raise bad_request(f"{name} is not supported, got {short_repr(value)}", name)
        elif name not in known:
            raise bad_request(f"unknown parameter {short_repr(name)}", str(name))


def _common(body: dict[str, Any]) -> tuple[str, bool, bool, dict[str, Any]]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(f"model must be a non-empty string, got {short_repr(model)}", "model")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {short_repr(stream)}", "stream")
    options = body.get("stream_options") or {}
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if not isinstance(usage, bool) or set(options) - {"include_usage"}:
        raise bad_request(
            "stream_options must be {'include_usage': true|false}, "
            f"got {short_repr(body.get('stream_options'))}",
            "stream_options",
        )
    user = body.get("user")
    if user is not None and not (isinstance(user, str) and len(user) <= MAX_USER):
        raise bad_request(f"user must be a string of at most {MAX_USER} characters", "user")
    return model, stream, usage, {} if user is None else {"user": user}


def _sampling(body: dict[str, Any], extra: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    check_seed(body)
    values = {SAMPLING[k]: v for k, v in body.items() if k in SAMPLING and v is not None}
    values.update(extra)
    constraint, name = structured_of(body)
    if constraint is not None and "structured_outputs" in values:
        raise bad_request(
            f"{name} cannot be combined with tool_choice={body['tool_choice']!r}", name
        )
    if constraint is not None:
        values["structured_outputs"] = constraint
        names["structured_outputs"] = name
    try:
        return SamplingParams(**values)
    except FieldError as exc:
        raise field_error(exc, names=names) from None


def stream_of(body: dict[str, Any]) -> str:
    """vLLM's per-request ``priority`` (an integer, lower first, 0 by default) on the
    pool's two streams: above 0 the batch stream (read by workers with the capacity
    interactive jobs leave), else the interactive one."""
    priority = body.get("priority")
    if priority is None:
        return "interactive"
    if not (_is_token(priority) and abs(priority) < 2**63):
        raise bad_request(f"priority must be an integer, got {short_repr(priority)}", "priority")
    return "batch" if priority > 0 else "interactive"


def parse_completion(body: Any, max_prompts: int) -> Parsed:
    """POST /v1/completions: prompt (a string, token ids, or a batch of either)."""
    body = _require_object(body)
    _check_known(body, COMPLETIONS)
    model, stream, usage, metadata = _common(body)
    prompts = _prompts(body.get("prompt"), max_prompts)
    logprobs, echo = body.get("logprobs"), body.get("echo") or False
    extra = {} if logprobs is None else {"logprobs": logprobs}
    if not isinstance(echo, bool):
        raise bad_request(f"echo must be true or false, got {short_repr(echo)}", "echo")
    asked = body.get("prompt_logprobs")
    if echo and _is_token(logprobs):  # the prompt's tokens get logprobs too
        extra["prompt_logprobs"] = max(logprobs, asked) if _is_token(asked) else asked or logprobs
    params = _sampling(body, extra, {})
    parsed = Parsed(model, prompts, params, stream, usage, metadata)
    parsed.priority, parsed.echo = stream_of(body), echo
    return parsed


def _prompts(prompt: Any, max_prompts: int) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    if (
        isinstance(prompt, list)
        and 0 < len(prompt) <= max_prompts
        and all(isinstance(p, str | list) for p in prompt)
    ):
        return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]
    raise bad_request(
        "prompt must be a string, a list of token ids, or a list of 1 to "
        f"{max_prompts} of either, got {short_repr(prompt)}",
        "prompt",
    )


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_chat(body: Any, tool_parser: str = "hermes", max_bytes: int = 1 << 20) -> Parsed:
    """POST /v1/chat/completions: messages (and tools), the template applied by the
    worker; ``tool_parser``: the family parser of ``tool_choice="auto"`` replies."""
    body = _require_object(body)
    _check_known(body, CHAT)
    model, stream, usage, metadata = _common(body)
    names = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}
    extra = _chat_logprobs(body)
    if body.get("max_completion_tokens") is not None:
        extra["max_tokens"] = body["max_completion_tokens"]
    else:
        names.pop("max_tokens")
    if "max_tokens" not in extra and body.get("max_tokens") is None:
        extra["max_tokens"] = None  # OpenAI's chat default: up to the context length
    tools = tools_of(body, max_bytes, tool_parser)
    if tools is not None and tools.constraint is not None:
        extra["structured_outputs"] = tools.constraint
    params = _sampling(body, extra, names)
    messages = [_message(i, m) for i, m in enumerate(_message_list(body.get("messages")))]
    chat = {"messages": messages, **({"tools": tools.tools} if tools else {})}
    return Parsed(model, [chat], params, stream, usage, metadata, names, tools, stream_of(body))


def _chat_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad_request(f"logprobs must be true or false, got {short_repr(wanted)}", "logprobs")
    if top is not None and not wanted:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    return {"logprobs": 0 if top is None else top} if wanted else {}


def _message_list(messages: Any) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            f"messages must be a non-empty list, got {short_repr(messages)}", "messages"
        )
    return messages


def _message(i: int, message: Any) -> Any:
    """One message as the job carries it: content parts of type text joined, null
    fields dropped (the job boundary checks the rest)."""
    if not isinstance(message, dict):
        return message
    message = {k: v for k, v in message.items() if v is not None and k not in ECHOED}
    content = message.get("content")
    if isinstance(content, list):
        texts = [
            p.get("text") if isinstance(p, dict) and p.get("type") == "text" else p for p in content
        ]
        if not all(isinstance(t, str) for t in texts):
            raise bad_request(
                f"messages[{i}].content parts must be of type text", f"messages[{i}].content"
            )
        message["content"] = "".join(texts)
    return message


def parse_job(body: Any) -> tuple[Parsed, str | None, str | None]:
    """POST /v1/jobs: one prompt (as /v1/completions) or one chat (as /v1/chat/completions),
    and optionally the client's own ``request_id`` and an ``on_finish`` webhook URL."""
    body = _require_object(body)
    if "stream" in body:
        raise bad_request("a job streams through GET /v1/jobs/{id}/events", "stream")
    core = {k: v for k, v in body.items() if k not in ("request_id", "on_finish")}
    parsed = parse_chat(core) if "messages" in core else parse_completion(core, 1)
    if len(parsed.prompts) != 1:
        raise bad_request("a job has one prompt", "prompt")
    return parsed, body.get("request_id"), _webhook(body.get("on_finish"))


def _webhook(value: Any) -> str | None:
    """A job's ``on_finish`` over HTTP: an http(s) URL only (a dotted function path would
    have the web app's RQ workers run a function an HTTP client named), whose form the
    egress module accepts; where it points is checked by ``Pool.check_webhook``."""
    if value is None:
        return None
    try:
        url = check_on_finish(value)
        split_url(url)
    except (FieldError, EgressRefused) as exc:
        raise bad_request(f"on_finish: {exc}", "on_finish") from None
    return url
