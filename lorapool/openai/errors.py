"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

The job boundary (``wire.job_from_dict``) raises FieldError naming a job field
(``sampling_params.seed must be ...``); ``field_error`` turns it into a 400 that
names the request's own parameter, or a 413 for a prompt over the size limit.
"""

from __future__ import annotations

import re
from http import HTTPStatus

from lorapool.protocol import SamplingParams
from lorapool.records.error_kind import ErrorKind
from lorapool.records.errors import FieldError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}
_FIELD = re.compile(r"(?:sampling_params\.)?([a-z_]+)")
# the job fields a FieldError may name first (besides SamplingParams' own)
_JOB_FIELDS = {"prompt", "prompt_token_ids", "messages", "metadata", "request_id"}


class APIError(Exception):
    """An HTTP error the client sees in OpenAI's shape (``body()``: the same object a
    stream's error event carries)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": error_object(self.status, self.message, self.param, self.code)}


def error_object(status: int, message: str, param: str | None = None, code=None) -> dict:
    """OpenAI's error object for an HTTP ``status``."""
    try:
        phrase = HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        phrase = "error"
    kind = _TYPES.get(status) or ("server_error" if status >= 500 else phrase)
    return {"message": message, "type": kind, "param": param, "code": code}


def job_lost(public_id: str | None = None) -> APIError:
    """503 ``job_lost``: a job whose marker and chunk log vanished from Redis (a Redis
    restarted without persistence, a FLUSHDB, an operator's DEL: ``JobLost``). It will
    never finish; the same request submitted again runs (the openai client's retry of a
    503 does that, after Retry-After)."""
    which = f"job {public_id}" if public_id else "the job"
    return APIError(
        503,
        f"{which} was lost: its state is gone from Redis (a Redis restart without "
        "persistence, FLUSHDB or DEL); it will not finish, submit it again",
        code="job_lost",
        headers={"Retry-After": "1"},
    )


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist", "model", code="model_not_found")


def _named_field(exc: ValueError, message: str) -> str | None:
    """The job field a FieldError is about, by its ``field`` path
    (``"sampling_params.seed"``, ``"prompt_token_ids[3]"``); "prompt" for one about the
    prompt in general. A FieldError raised without a path (a check of the chat's
    messages, a stand-in's): read from its message, which begins with the field."""
    path = getattr(exc, "field", None)
    about = path if path is not None else message
    match = _FIELD.match(about)
    field = match.group(1) if match else None
    if about.startswith("sampling_params.") and field in SamplingParams.__struct_fields__:
        return field
    if field in _JOB_FIELDS:
        return "prompt" if field == "prompt_token_ids" else field
    return "prompt" if path is None and "prompt" in message else None


def field_error(
    exc: ValueError, request_id: str = "", names: dict[str, str] | None = None
) -> APIError:
    """The APIError of a FieldError from the job boundary.

    ``names`` maps a job field to the request's parameter that set it (chat's
    ``top_logprobs`` sets ``logprobs``); the job's request id is cut from the message.
    """
    message = str(exc).removeprefix(f"job {request_id}: ") if request_id else str(exc)
    if "over the limit of" in message and "max_prompt_bytes" in message:
        return APIError(413, message, "prompt", code="prompt_too_large")
    field = _named_field(exc, message)
    param = (names or {}).get(field, field)
    prefix = f"sampling_params.{field}"
    if message.startswith(prefix) and param:
        message = param + message[len(prefix) :]
    return APIError(400, message, param)


def failed_request(
    error: str,
    kind: str | None,
    request_id: str,
    public_id: str,
    names: dict[str, str] | None = None,
    path: str | None = None,
) -> APIError:
    """The APIError of a request its worker failed, by its ``kind`` (``ErrorKind``): 500
    for an engine fault, else 400 naming the request's parameter (chat's
    ``top_logprobs`` as such), the internal request id replaced by the one the client
    knows. ``path``: the refused job field's path its final chunk carries
    (``RequestOutput.error_field``): the parameter is found by it alone, never in the
    message's words (a refusal that names no field, or a worker of the version before
    paths, has no ``param``)."""
    message = error.replace(request_id, public_id) if request_id else error
    if kind == ErrorKind.ENGINE:
        return APIError(500, message, code="engine_error")
    if path is None:
        return APIError(400, message)
    field = "adapter" if path == "adapter" else _named_field(FieldError("", field=path), "")
    if field == "adapter":
        return APIError(400, message, "model")
    param = (names or {}).get(field, field)
    if field and param != field and field != "prompt":
        message = re.sub(rf"\b{field}\b", param, message)
    return APIError(400, message, param)
