"""A request's structured output, from OpenAI's ``response_format`` or vLLM's
``guided_*`` / ``structured_outputs`` parameters, checked before anything is queued.

One way per request: two of them is a 400 naming both. Only the shape is read here:
compiling the constraint (to refuse an invalid schema, regex or grammar with a 400
naming the parameter and the problem) is each door's next step, after the caller's
rate checks, in a sandbox process off the event loop (``lorapool.grammar_sandbox``;
``grammar_error`` words its refusal).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from lorapool.openai.bodies import JsonObjectFormat, JsonSchemaFormat, TextFormat
from lorapool.openai.errors import bad_request
from lorapool.protocol import FieldError
from lorapool.records.structured import StructuredOutputsParams

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
PARAMETERS = ("response_format", "structured_outputs", *GUIDED)
_GIVEN = attrgetter(*PARAMETERS)


def structured_of(request) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint of ``request``, a ``bodies`` Struct; the parameter it came from);
    (None, None) without one."""
    values = _GIVEN(request)
    if values.count(None) == len(PARAMETERS):  # (most requests: at once)
        return None, None
    given = [name for name, value in zip(PARAMETERS, values) if value is not None]
    if isinstance(request.response_format, TextFormat):
        given.remove("response_format")
    if len(given) > 1:
        raise bad_request(f"give one of {', '.join(given)}, not several", given[1])
    if not given:
        return None, None
    name = given[0]
    try:
        params = _params(name, getattr(request, name), request.guided_whitespace_pattern)
    except FieldError as exc:
        message = str(exc).removeprefix("sampling_params.structured_outputs")
        raise bad_request(f"{name}: {message.lstrip('.: ')}", name) from None
    except (TypeError, ValueError) as exc:
        raise bad_request(f"{name}: {exc}", name) from None
    return params, name


def _params(name: str, value: Any, whitespace: Any) -> StructuredOutputsParams:
    extra = {} if whitespace is None else {"whitespace_pattern": whitespace}
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return StructuredOutputsParams.from_dict(value)
    return StructuredOutputsParams(**{GUIDED[name]: value}, **extra)


def _response_format(value: JsonObjectFormat | JsonSchemaFormat) -> StructuredOutputsParams:
    """OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}}`` (their shapes: ``bodies``)."""
    if isinstance(value, JsonObjectFormat):
        return StructuredOutputsParams(json_object=True)
    spec = value.json_schema
    strict = bool(spec.strict)
    return StructuredOutputsParams(json=spec.schema, disable_additional_properties=strict)


def grammar_error(exc: FieldError, parsed) -> tuple[str, str]:
    """(message, parameter) of a 400 for ``parsed``'s constraint that the sandbox refused
    (``exc``): the parameter it came from, ``tools`` for a tool call's."""
    name = parsed.names.get("structured_outputs")
    if name is None:
        return f"tools: a function's parameters do not compile: {exc}", "tools"
    message = str(exc).removeprefix("sampling_params.structured_outputs")
    return f"{name}: {message.lstrip('.: ')}", name
