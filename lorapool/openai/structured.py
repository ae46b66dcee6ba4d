"""A request's structured output, from OpenAI's ``response_format`` or vLLM's
``guided_*`` / ``structured_outputs`` parameters, checked before anything is queued.

One way per request: two of them is a 400 naming both. The constraint is compiled
once here (llguidance, no tokenizer needed), so an invalid schema, regex or grammar
gets a 400 naming the parameter and the problem rather than a failed job.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from lorapool.openai.bodies import JsonObjectFormat, JsonSchemaFormat, TextFormat
from lorapool.openai.errors import bad_request
from lorapool.protocol import FieldError
from lorapool.structured import StructuredOutputsParams, check_grammar

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
        check_grammar(params)
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
