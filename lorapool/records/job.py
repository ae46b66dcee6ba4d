"""Jobs on the queue ``{p}:requests``: JSON in a stream entry's field ``data``, with
``"v": 1``. (Chunks, on ``{p}:out:<id>``, are ``records.chunk``'s.)

``Job`` is a msgspec Struct whose field types carry their bounds (``lorapool.records.bounds``;
its ``SamplingParams`` and ``LoRARequest`` are Structs too): decoding (bytes from Redis,
``decode_job``) and a producer's check (a dict, ``job_from_dict``) are msgspec's typed
decoding, then the few checks no one field's type says (``_check``: one prompt within
``JobLimits``' size, ``n`` at most ``max_n``, the metadata's size, the chats' messages).
Every refusal is a FieldError (a ValueError) naming the field, by text and by path
(workers dead-letter such entries). Encoding is orjson of ``Job.to_dict``, the same
bytes as before the job was typed. Torch-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from lorapool.records.bounds import RequestId, ResultTtl, Seconds, TokenIds, is_request_id
from lorapool.records.errors import invalid
from lorapool.records.messages import check_json_size, check_messages, check_tools, utf8_size
from lorapool.records.outputs import wire_head
from lorapool.records.params import (
    WIRE_VERSION,
    FieldError,
    LoRARequest,
    SamplingParams,
    check,
    is_int,
    short_repr,
    with_token_keys,
)

DATA = "data"  # the stream entry field holding the record


class Job(msgspec.Struct, forbid_unknown_fields=True):
    """One generation job as producers enqueue it. Each field's bound is its type
    (``lorapool.records.bounds``); ``decode_job``/``job_from_dict`` have msgspec check them and
    then check what no one field says (``_check``)."""

    request_id: RequestId
    prompt: str | None = None
    prompt_token_ids: TokenIds | None = None
    sampling_params: SamplingParams | None = None  # None: the defaults (decoded: never None)
    lora_request: LoRARequest | None = None
    metadata: dict[str, Any] | None = msgspec.field(default_factory=dict)  # None: {}
    arrival_time: Seconds | None = msgspec.field(default_factory=time.time)  # None: now
    result_ttl_s: ResultTtl | None = None  # None: the worker's --result-ttl
    # a chat: [{"role", "content"}, ...]; the worker applies the model's chat template
    # (their shapes: ``lorapool.records.messages``)
    messages: Any = None
    tools: Any = None  # a chat's tools, for its chat template
    version: Any = msgspec.field(default=WIRE_VERSION, name="v")

    @property
    def engine_prompt(self) -> str | dict[str, Any]:
        """What ``LLMEngine.add_request`` takes as its prompt (for a chat, see
        ``lorapool.worker.prompt``)."""
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": self.prompt_token_ids, "prompt": self.prompt}
        return self.prompt

    def to_dict(self) -> dict[str, Any]:
        return {
            **wire_head(self),
            "sampling_params": self.sampling_params.to_dict(),
            "lora_request": None if self.lora_request is None else self.lora_request.to_dict(),
            "metadata": self.metadata,
            "arrival_time": self.arrival_time,
            **{k: v for k in ("result_ttl_s", "messages", "tools") if (v := getattr(self, k))},
        }


def _fail(message: str) -> None:
    raise ValueError(message)


def _loads(
    payload: bytes | str | None, what: str, speaks: int = WIRE_VERSION, implied: Any = None
) -> dict[str, Any]:
    """The record's JSON object, of version ``speaks`` (``implied`` when it names none)."""
    if payload is None:
        _fail(f"malformed {what}: no {DATA!r} field")
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"malformed {what}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        _fail(f"malformed {what}: expected an object, got {type(data).__name__}")
    version = data.get("v", implied)
    if version != speaks:
        _fail(f"unknown wire version {version!r} in {what} (this build speaks {speaks})")
    return data


def encode_job(job: Job) -> bytes:
    """The job's JSON. A job built in Python may hold a lone surrogate where no check
    counts UTF-8 (a stop string, a message's role, the request id): a FieldError naming
    the field, looked for only once orjson has refused the job."""
    data = job.to_dict()
    try:
        return orjson.dumps(data)
    except orjson.JSONEncodeError:
        try:
            _check_utf8(data, "")
        except FieldError as exc:
            raise _for_job(job.request_id, exc) from None
        raise


def _check_utf8(value: Any, path: str) -> None:
    """FieldError (``utf8_size``'s) at the first string of ``value`` that UTF-8 cannot
    hold, named by its path (a dict's own path for one of its keys)."""
    if isinstance(value, str):
        utf8_size(value, path)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                utf8_size(key, path)
            _check_utf8(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_utf8(item, f"{path}[{i}]")


DEFAULT_MAX_PROMPT_BYTES = 1 << 20
DEFAULT_MAX_N = 128
MAX_METADATA_BYTES = 64 << 10


@dataclass(frozen=True)
class JobLimits:
    """Sizes a deployment accepts; producers check them at submit, workers at decode.

    max_prompt_bytes: the prompt's UTF-8 text plus 4 bytes per prompt token id.
    max_n: completions per request (each one holds its own KV blocks).
    """

    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    max_n: int = DEFAULT_MAX_N

    def __post_init__(self):
        for name in ("max_prompt_bytes", "max_n"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


_DECODER = msgspec.json.Decoder(Job)


def decode_job(payload: bytes | str | None, limits: JobLimits | None = None) -> Job:
    """A validated Job from a stream entry's payload; ValueError naming the problem."""
    if payload is None:
        _fail(f"malformed job: no {DATA!r} field")
    try:
        job = _DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        raise _refused(exc, _loads(payload, "job")) from None
    except msgspec.DecodeError as exc:
        _loads(payload, "job")  # says how it is malformed, where orjson finds it so
        raise ValueError(f"malformed job: {exc}") from None
    return _check(job, limits or JobLimits(), from_json=True)


def job_from_dict(data: Any, limits: JobLimits | None = None) -> Job:
    """The one validation boundary of a job: producers (at submit) and workers use it.

    Checks the type and range of every field; raises FieldError (a ValueError)
    naming the field and its value.
    """
    if not isinstance(data, dict):
        raise FieldError(f"a job must be an object, got {short_repr(data)}")
    params = data.get("sampling_params")
    if isinstance(params, dict):
        data = {**data, "sampling_params": with_token_keys(params)}
    try:
        job = msgspec.convert(data, Job)
    except msgspec.ValidationError as exc:
        raise _refused(exc, data) from None
    return _check(job, limits or JobLimits())


def _refused(exc: msgspec.ValidationError, data: dict[str, Any]) -> FieldError:
    """The FieldError of a job msgspec refused (``data``: the job as Python objects), its
    message opening ``job <request_id>: `` once the id itself is good."""
    _check_version(data.get("v", WIRE_VERSION))
    return _for_job(data.get("request_id"), invalid(exc, data, Job))


def _for_job(rid: Any, error: FieldError) -> FieldError:
    """``error`` opening ``job <request_id>: ``, unless the id is what it is about or is
    not good enough to print."""
    if error.field == "request_id" or not is_request_id(rid):
        return error
    return FieldError(f"job {rid}: {error}", rid, error.field)


def _check_version(version: Any) -> None:
    if version != WIRE_VERSION:
        raise FieldError(
            f"unknown wire version {short_repr(version)} in job (this build speaks {WIRE_VERSION})"
        )


def _check(job: Job, limits: JobLimits, from_json: bool = False) -> Job:
    """What msgspec's types cannot say: the version, one prompt of a size, at most
    ``max_n`` completions, the metadata's size; the defaults of what was null.
    ``from_json``: decoded from JSON text, whose strings are valid Unicode (msgspec
    refuses lone surrogates), which Python's need not be."""
    _check_version(job.version)
    try:
        job.messages = check_messages(job.messages, limits.max_prompt_bytes)
        job.tools = check_tools(job.tools, limits.max_prompt_bytes, job.messages is not None)
        _check_prompt(job, limits, from_json)
        if job.sampling_params is None:
            job.sampling_params = SamplingParams()
        n = job.sampling_params.n
        check(
            n <= limits.max_n,
            f"sampling_params.n must be at most {limits.max_n} (max_n), got {n}",
            "sampling_params.n",
        )
        if job.metadata is None:
            job.metadata = {}
        check_json_size(job.metadata, "metadata", MAX_METADATA_BYTES)
    except FieldError as exc:
        raise FieldError(f"job {job.request_id}: {exc}", job.request_id, exc.field) from None
    if job.arrival_time is None:
        job.arrival_time = time.time()
    return job


def _check_prompt(job: Job, limits: JobLimits, from_json: bool) -> None:
    if job.messages is not None:
        check(
            job.prompt is None and job.prompt_token_ids is None,
            "a job has either messages or a prompt (prompt_token_ids), not both",
            "prompt",
        )
        return
    if job.prompt_token_ids is None:
        check(
            bool(job.prompt),
            "the job needs a non-empty prompt, prompt_token_ids or messages",
            "prompt",
        )
    size = 4 * len(job.prompt_token_ids or ())
    if job.prompt and not (from_json and size + 4 * len(job.prompt) <= limits.max_prompt_bytes):
        # (valid text of at most a quarter of the limit's characters fits whatever it is:
        # UTF-8 takes at most 4 bytes a character; a worker need not encode a copy)
        size += utf8_size(job.prompt, "prompt")
    check(
        size <= limits.max_prompt_bytes,
        f"the prompt is {size} bytes, over the limit of {limits.max_prompt_bytes} "
        "(max_prompt_bytes)",
        "prompt",
    )
