"""The OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``, ``/v1/jobs``)
as msgspec Structs: one definition that parses a body, bounds its values and describes it
in the gateway's OpenAPI document (``schema_components``), so the document cannot drift
from what is enforced.

A bound here is the job boundary's own (``SamplingParams`` meets the same values again,
for Python producers and workers); what no type can say (``top_k`` not 0, ``min_tokens``
up to ``max_tokens``, a grammar that compiles) stays with the checks that know it.
Every field may be null, as OpenAI's clients send them; null is "not given".
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from lorapool.lifecycle.submit import MAX_ON_FINISH
from lorapool.openai.body_errors import invalid
from lorapool.openai.errors import APIError, bad_request
from lorapool.openai.nesting import check_nesting
from lorapool.protocol import short_repr
from lorapool.records.bounds import (
    INT64_MAX,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_NAME,
    MAX_REQUEST_ID,
    MAX_ROLE,
    Count,
    LogitBias,
    MinP,
    NonNegative,
    Penalty,
    RepetitionPenalty,
    StopString,
    StopStrings,
    Temperature,
    TokenId,
    TopK,
    TopP,
)

# The bounds are the job boundary's own (``lorapool.records.bounds``, which ``SamplingParams``
# checks); these two are the OpenAI routes' alone.
MAX_USER = 256
INT64_MIN = -INT64_MAX - 1
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]  # vLLM's API: seed, priority
# A message's role and names, a job's request_id: the lengths of bounds.Role, ShortName
# and RequestId; their patterns (no NUL, no braces: msgspec matches a pattern with a
# regex, 0.4 us a string) are left to the job boundary, which every job meets anyway.
RoleText = Annotated[str, Meta(min_length=1, max_length=MAX_ROLE)]
NameText = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
RequestIdText = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID)]
IGNORED_DOC = "accepted and ignored: it does not change the output"
LEGACY = "the legacy form of tools: the reply's function_call (tools.py)"
TokenBias = Annotated[
    dict[Annotated[str, Meta(pattern="^[0-9]{1,10}$", description="a token id")], LogitBias],
    Meta(max_length=MAX_LOGIT_BIAS),
]


class JsonSchema(Struct, kw_only=True):
    """OpenAI's ``json_schema``: the JSON schema the reply follows; ``strict`` closes
    every object of it to unlisted properties (OpenAI's strict mode)."""

    schema: dict[str, Any] = msgspec.field(default_factory=dict)
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class TextFormat(Struct, tag="text", tag_field="type"):
    """Plain text: no constraint."""


class JsonObjectFormat(Struct, tag="json_object", tag_field="type"):
    """Any JSON object."""


class JsonSchemaFormat(Struct, tag="json_schema", tag_field="type"):
    json_schema: JsonSchema


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class _Body(Struct, kw_only=True, forbid_unknown_fields=True):
    """What every generation body may carry: the pool's sampling parameters (vLLM's)."""

    model: Annotated[
        str, Meta(min_length=1, description="an adapter of the registry, or the base model")
    ]
    n: Annotated[Count, Meta(description="completions per prompt")] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[TopK, Meta(description="-1 (off) or at least 1")] | None = None
    min_p: MinP | None = None
    stop: StopString | StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: NonNegative | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: TokenBias | None = None
    prompt_logprobs: NonNegative | None = None
    user: (
        Annotated[str, Meta(max_length=MAX_USER, description="kept in the job's metadata")] | None
    ) = None
    priority: Annotated[Int64, Meta(description="above 0: the batch stream")] | None = None
    # structured outputs (checked and compiled by ``structured.structured_of``)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Any = None  # accepted and ignored: one engine serves all
    guided_whitespace_pattern: str | None = None
    best_of: Annotated[None, Meta(description="not supported")] = None
    # OpenAI's fields that do not change what the pool generates: accepted, ignored,
    # named in the reply's ``IGNORED_HEADER`` (``IGNORED``)
    store: Annotated[bool, Meta(description=IGNORED_DOC)] | None = None
    metadata: Annotated[dict[str, Any], Meta(description=IGNORED_DOC)] | None = None
    service_tier: Annotated[str, Meta(description=IGNORED_DOC)] | None = None
    reasoning_effort: Annotated[str, Meta(description=IGNORED_DOC)] | None = None
    prompt_cache_key: Annotated[str, Meta(description=IGNORED_DOC)] | None = None
    safety_identifier: Annotated[str, Meta(description=IGNORED_DOC)] | None = None
    verbosity: Annotated[str, Meta(description=IGNORED_DOC)] | None = None
    prediction: Annotated[Any, Meta(description=IGNORED_DOC)] = None
    # text out only: audio (or any other modality) would change the output
    modalities: list[Literal["text"]] | None = None
    audio: Annotated[None, Meta(description="not supported")] = None
    web_search_options: Annotated[None, Meta(description="not supported")] = None


# the _Body fields of IGNORED_DOC, whose value is dropped (named in the reply's header)
IGNORED = ("store", "metadata", "service_tier", "reasoning_effort", "prompt_cache_key",
           "safety_identifier", "verbosity", "prediction", "modalities")  # fmt: skip


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no obfuscation padding is sent: ignored


class _Streamed(_Body, kw_only=True):
    stream: Annotated[bool, Meta(description="OpenAI's SSE chunks, then data: [DONE]")] | None = (
        None
    )
    stream_options: StreamOptions | None = None


class CompletionRequest(_Streamed, kw_only=True):
    """POST /v1/completions."""

    prompt: Annotated[
        str | list[int | str | list[int]],
        Meta(description="a string, token ids, or a batch of either (one job each)"),
    ]
    max_tokens: Annotated[Count, Meta(description="16 when not given")] | None = None
    logprobs: Annotated[NonNegative, Meta(description="top alternatives per token")] | None = None
    echo: bool | None = None
    suffix: Annotated[None, Meta(description="not supported")] = None


class TextPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class LegacyCall(Struct, kw_only=True):
    """An assistant's legacy ``function_call``: the function and its JSON arguments."""

    name: NameText
    arguments: str = "{}"


class Message(Struct, kw_only=True, forbid_unknown_fields=True):
    """One chat message (its fields as ``lorapool.records.messages`` checks them)."""

    role: RoleText
    content: (
        Annotated[str | list[str | TextPart], Meta(description="text, or parts of type text")]
        | None
    ) = None
    name: NameText | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: NameText | None = None
    # a reply's fields that a client sends back with it (openai's
    # ``messages.append(completion.choices[0].message)``): dropped, they never reach the model
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    reasoning_content: Any = None
    function_call: LegacyCall | None = None  # legacy: its one tool call (``_legacy_turn``)

    def to_job(self) -> dict[str, Any]:
        """The message as a chat job carries it: null and echoed fields dropped, text
        parts joined."""
        out: dict[str, Any] = {"role": self.role}
        content = self.content
        if content.__class__ is list:
            content = "".join(p if isinstance(p, str) else p.text for p in content)
        if content is not None:
            out["content"] = content
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.function_call is not None or self.role == "function":
            _legacy_turn(self, out)
        return out


def _legacy_turn(message: Message, out: dict[str, Any]) -> None:
    """A legacy turn as tools carry it: an assistant's ``function_call`` as its one tool
    call, a ``function`` message as the ``tool`` message answering it (the id
    ``call_<function>`` pairs them: a legacy turn makes one call)."""
    call = message.function_call
    if call is not None and message.tool_calls is None:
        function = {"name": call.name, "arguments": call.arguments}
        out["tool_calls"] = [{"id": f"call_{call.name}", "type": "function", "function": function}]
    elif message.role == "function":
        out["role"] = "tool"
        out.setdefault("tool_call_id", f"call_{message.name or ''}")


class FunctionName(Struct):
    name: Annotated[str, Meta(min_length=1)]


class FunctionDef(Struct, kw_only=True):
    """A legacy ``functions`` entry (``tools``' function, before tools)."""

    name: NameText
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(Struct):
    """The function of ``tools`` the reply calls."""

    type: Literal["function"]
    function: FunctionName


# none: the reply is content; auto (the default with tools): the model's text parsed for
# calls; required: calls forced (``tools.ToolRequest``)
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Messages = Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]


class Chat(Struct):
    """A body's messages, its other fields not read (vLLM's /tokenize)."""

    messages: Messages


class ChatRequest(_Streamed, kw_only=True):
    """POST /v1/chat/completions: the worker applies the model's chat template."""

    messages: Messages
    max_tokens: Annotated[Count, Meta(description="up to the context when not given")] | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: NonNegative | None = None
    tools: list[dict[str, Any]] | None = None  # checked by ``tools.tools_of``
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's legacy form of tools and tool_choice (one call, ``message.function_call``)
    functions: Annotated[list[FunctionDef], Meta(description=LEGACY)] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None


RETRY = "the client's own id: a retry finds the same job"
WEBHOOK = "a webhook URL (http or https) POSTed the result, signed, once it is stored"
_JOB = [
    ("request_id", Annotated[RequestIdText, Meta(description=RETRY)] | None, None),
    ("on_finish", Annotated[str, Meta(max_length=MAX_ON_FINISH, description=WEBHOOK)] | None, None),
]
_JOB_DOC = "POST /v1/jobs: one {} (no stream), read back through /v1/jobs/{{id}}."
CompletionJob = msgspec.defstruct(
    "CompletionJob", _JOB, bases=(CompletionRequest,), namespace={"__doc__": _JOB_DOC.format(
        "prompt")}, kw_only=True, forbid_unknown_fields=True
)  # fmt: skip
ChatJob = msgspec.defstruct(
    "ChatJob", _JOB, bases=(ChatRequest,), namespace={"__doc__": _JOB_DOC.format("chat")},
    kw_only=True, forbid_unknown_fields=True,
)  # fmt: skip
BODIES = (CompletionRequest, ChatRequest, CompletionJob, ChatJob)


class JobKind(Struct):
    """What tells a /v1/jobs body's kind, read without building the rest (``Raw``):
    a chat has ``messages``; ``stream``, even null, is refused."""

    messages: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    stream: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


def parse(body: bytes | Any, kind: type[Struct], unknown: list[str] | None = None) -> Any:
    """``body`` (the request's JSON bytes, or its value already read) as ``kind``; a
    400 naming the request's parameter otherwise, or the nesting past ``MAX_JSON_DEPTH``
    (``nesting.py``), refused before it is decoded.

    ``unknown`` (a list): top-level fields ``kind`` does not know are dropped and named
    in it (vLLM's way with fields it does not know); without it they are a 400."""
    try:
        if isinstance(body, bytes | bytearray | memoryview):
            check_nesting(body)
            return msgspec.json.decode(body, type=kind)
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        if unknown is not None and _UNKNOWN_TOP.match(str(exc)):
            return parse(_known(body, kind, unknown), kind)
        raise invalid(str(exc), body, kind) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # the latter: bad UTF-8 in a string
        raise not_json(exc) from None
    except RecursionError:  # a value already read, nested past Python's stack
        raise APIError(400, "the request body nests too deep", code="json_too_deep") from None


_UNKNOWN_TOP = re.compile(r"Object contains unknown field `[^`]*`$")  # no "- at `$...`"


def not_json(exc: Exception) -> APIError:
    return APIError(400, f"the request body is not valid JSON: {exc}")


def _known(body: bytes | Any, kind: type[Struct], unknown: list[str]) -> dict[str, Any]:
    """``body``'s object without the fields ``kind`` does not know (named in ``unknown``);
    a 400 for one that another route's body knows (chat's ``top_logprobs`` given to a
    completion would change the output there: it is refused, not dropped)."""
    if isinstance(body, bytes | bytearray | memoryview):
        try:  # the typed decode stopped at the unknown field: the rest may not be JSON
            body = msgspec.json.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise not_json(exc) from None
    fields = kind.__struct_fields__
    extra = [name for name in body if name not in fields]
    if misplaced := [name for name in extra if name in _route_fields()]:
        raise bad_request(f"unknown parameter {short_repr(misplaced[0])}", misplaced[0])
    unknown += extra
    return {name: value for name, value in body.items() if name in fields}


@functools.cache
def _route_fields() -> frozenset[str]:
    """Every field of a generation body of the gateway's routes."""
    from lorapool.openai.response_bodies import ResponsesRequest

    kinds = (*BODIES, ResponsesRequest)
    return frozenset(name for kind in kinds for name in kind.__struct_fields__)


REF = "#/components/schemas/{name}"


def schema_components() -> dict[str, Any]:
    """The bodies and what they refer to, as OpenAPI component schemas."""
    from lorapool.openai.response_bodies import ResponsesRequest

    _, components = msgspec.json.schema_components((*BODIES, ResponsesRequest), ref_template=REF)
    return components


def openapi_body(*kinds: type[Struct]) -> dict[str, Any]:
    """``openapi_extra`` describing a route's JSON body as one of ``kinds``."""
    refs = [{"$ref": REF.format(name=kind.__name__)} for kind in kinds]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
