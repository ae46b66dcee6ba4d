"""One line of a batch input file, checked: OpenAI's ``custom_id``, ``method``, ``url``,
``body`` as the Struct ``Line`` (msgspec, worded as the OpenAI bodies' errors are:
``body_errors``); the body through the gateway's own parser (``openai.serving.parse``)
and the job boundary (``wire.job_from_dict`` via ``build_job``), so a batch line is
refused exactly when the same request over HTTP would be."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from lorapool.lifecycle.submit import build_job
from lorapool.openai.body_errors import invalid
from lorapool.openai.errors import APIError
from lorapool.openai.limits import check_stop_count
from lorapool.openai.nesting import check_nesting
from lorapool.openai.params import Parsed
from lorapool.openai.serving import ServingConfig, parse, submit_error
from lorapool.openai.structured import grammar_error
from lorapool.protocol import FieldError, short_repr
from lorapool.records.job import JobLimits

ENDPOINTS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
Endpoint = Literal[tuple(ENDPOINTS)]  # the urls a line may name
MAX_LINE_BYTES = 1 << 20
MAX_CUSTOM_ID = 64
MAX_ERRORS = 1000  # reasons kept for one file; the count goes on
LINE = ServingConfig(max_prompts=1)  # a line is one job: one prompt


class Line(Struct, forbid_unknown_fields=True):
    """A line of the input file as OpenAI's Batch API writes it; ``body`` is kept as
    its JSON text for the endpoint's own body parser (``parse_chat``,
    ``parse_completion``). Braces and NUL in ``custom_id`` are refused beside it
    (``_custom_id``): a pattern's message would name a regex."""

    custom_id: Annotated[str, Meta(min_length=1, max_length=MAX_CUSTOM_ID)]
    method: Literal["POST"]
    url: Endpoint
    body: msgspec.Raw


_decode = msgspec.json.Decoder(Line).decode


class LineError(ValueError):
    """A line that cannot run: ``field`` names what is wrong in it (or None)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass
class BatchLine:
    """A checked line: what to submit for it."""

    number: int  # 1-based line number in the input file
    custom_id: str
    url: str
    parsed: Parsed

    @property
    def kind(self) -> str:
        return ENDPOINTS[self.url]

    def request_id(self, batch_id: str) -> str:
        return f"{batch_id}:{self.custom_id}"


def parse_line(number: int, raw: bytes, batch_id: str, limits: JobLimits) -> BatchLine:
    """The line as a BatchLine; LineError naming the field otherwise (the batch's
    endpoint is checked by ``check_file``)."""
    if len(raw) > MAX_LINE_BYTES:
        raise LineError(f"the line is over {MAX_LINE_BYTES} bytes")
    try:
        check_nesting(raw, "the line")
        record = _decode(raw)
    except APIError as exc:
        raise LineError(exc.message) from None
    except msgspec.ValidationError as exc:
        error = invalid(str(exc), raw, Line)
        if error.param is None:  # not an object: worded for a line, not a request body
            raise LineError(error.message.replace("the request body", "a line", 1)) from None
        raise LineError(error.message, error.param) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # msgspec's for bad UTF-8
        raise LineError(f"not valid JSON: {exc}") from None
    custom_id = _custom_id(record.custom_id)
    parsed = _parse_body(memoryview(record.body), ENDPOINTS[record.url])
    line = BatchLine(number, custom_id, record.url, parsed)
    _check_job(line, batch_id, limits)
    return line


def _custom_id(value: str) -> str:
    if any(c in value for c in "{}\x00"):
        raise LineError(
            f"custom_id must not hold braces or NUL, got {short_repr(value)}", "custom_id"
        )
    return value


def _check_stop(line: BatchLine, max_stop: int) -> None:
    """The gateway's own bound on stop strings (``--max-stop``), with its message."""
    try:
        check_stop_count(line.parsed, max_stop)
    except APIError as exc:
        raise LineError(exc.message, f"body.{exc.param}") from None


def _parse_body(body: Any, kind: str) -> Parsed:
    try:
        # a field no route knows is refused here: a line's reply has no header to name it
        parsed = parse(kind, body, LINE, "hermes", drop_unknown=False)
    except APIError as exc:
        raise LineError(exc.message, f"body.{exc.param}" if exc.param else "body") from None
    except UnicodeDecodeError as exc:  # msgspec's for bad UTF-8 in a string
        raise LineError(f"not valid JSON: {exc}", "body") from None
    if parsed.stream:
        raise LineError("a batch line cannot stream", "body.stream")
    return parsed


def check_line_grammar(line: BatchLine, sandbox) -> None:
    """The line's structured output compiled in ``sandbox`` (a ``GrammarSandbox``, its
    limits first), as the gateway compiles a request's: LineError naming the limit or
    the problem, and a crash or a runaway costs a sandbox process, not the validator."""
    constraint = line.parsed.params.structured_outputs
    if constraint is None:
        return
    try:
        sandbox.check(constraint)
    except FieldError as exc:
        message, param = grammar_error(exc, line.parsed)
        raise LineError(message, f"body.{param}") from None


def _check_job(line: BatchLine, batch_id: str, limits: JobLimits) -> None:
    """The job boundary on the line's job, as a worker would check it."""
    rid = line.request_id(batch_id)
    try:
        build_job(line.parsed.prompts[0], line.parsed.params, None, rid, {}, limits)
    except FieldError as exc:
        error = submit_error(exc, rid, line.parsed.names)
        raise LineError(error.message, f"body.{error.param}" if error.param else "body") from None


@dataclass
class Report:
    """What checking a whole file found."""

    total: int = 0
    errors: list[dict[str, Any]] | None = None  # {"line", "param", "message"}
    num_errors: int = 0

    def add(self, number: int, error: LineError) -> None:
        self.num_errors += 1
        if len(self.errors) < MAX_ERRORS:
            message = f"line {number}: {error}"
            self.errors.append({"line": number, "param": error.field, "message": message})


def check_file(
    lines: Iterator[bytes],
    batch_id: str,
    known_model: Callable[[str], bool],
    limits: JobLimits | None = None,
    check: Callable[[BatchLine], None] | None = None,
    endpoint: str | None = None,
    max_stop: int = 4,
) -> Report:
    """Every line checked (one at a time): shape, url (the batch's ``endpoint``, as
    OpenAI's Batch API holds it), model, parameters (stop strings: at most ``max_stop``,
    the gateway's ``--max-stop``, as over HTTP), and custom_ids unique across the file,
    and ``check`` (raising LineError) when given. Blank lines are skipped."""
    report, seen, limits = Report(errors=[]), {}, limits or JobLimits()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        report.total += 1
        try:
            line = parse_line(number, raw, batch_id, limits)
            _check_stop(line, max_stop)
        except LineError as exc:
            report.add(number, exc)
            continue
        if endpoint is not None and line.url != endpoint:
            message = f"url {line.url!r} is not the batch's endpoint {endpoint!r}"
            report.add(number, LineError(message, "url"))
        if line.custom_id in seen:
            first = seen[line.custom_id]
            report.add(
                number, LineError(f"custom_id {line.custom_id!r} repeats line {first}", "custom_id")
            )
        else:
            seen[line.custom_id] = number
        if not known_model(line.parsed.model):
            report.add(number, LineError(f"unknown model {line.parsed.model!r}", "body.model"))
        elif check is not None:
            try:
                check(line)
            except LineError as exc:
                report.add(number, exc)
    if report.total == 0:
        report.add(0, LineError("the file has no requests"))
    return report


def read_lines(lines: Iterator[bytes], batch_id: str, limits: JobLimits) -> Iterator[BatchLine]:
    """The lines of a file already checked, parsed again one at a time."""
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            yield parse_line(number, raw, batch_id, limits)
