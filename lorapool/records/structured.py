"""Structured outputs: the constraint one request's completions must follow (vLLM's
``StructuredOutputsParams``), its checks, and the grammar it compiles to.

Torch-free, and free of the grammar engine at import: a producer builds and sends
constraints without it. ``grammar_of`` turns one into the grammar of llguidance
(the engine the worker masks tokens with, ``lorapool.engine.guide``), and
``check_grammar`` compiles that grammar once to refuse a bad schema, regex or
grammar with a message naming the problem. Callers that take constraints from tenants
do not call it in their own process: llguidance's native compiler can crash on a deep
one, so they count it against ``lorapool.grammar_limits`` and compile it in
``lorapool.grammar_sandbox``.

Exactly one of the kinds is set: ``json`` (a JSON schema, as an object or its text),
``regex``, ``choice`` (the completion is one of these strings), ``grammar`` (Lark,
or GBNF as llama.cpp and xgrammar write it) or ``json_object`` (any JSON object).
JSON is generated compact (no whitespace between tokens) unless
``disable_any_whitespace`` is false or a ``whitespace_pattern`` is given: a small
model let loose on free whitespace can emit it until max_tokens.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import msgspec
import orjson

from lorapool.records.errors import FieldError, invalid

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CONSTRAINT_BYTES = 256 << 10  # a schema, regex, grammar or the choices, encoded
MAX_CHOICES = 1024
WHERE = "sampling_params.structured_outputs"

Text = Annotated[str, msgspec.Meta(min_length=1)]
Choices = Annotated[list[Text], msgspec.Meta(min_length=1, max_length=MAX_CHOICES)]


class StructuredOutputsParams(msgspec.Struct, forbid_unknown_fields=True):
    """What a request's completions must match (vLLM's fields; one kind at a time). The
    types are the checks (msgspec's, when a job is decoded and in ``verify``)."""

    json: dict[str, Any] | str | None = None
    regex: Text | None = None
    choice: Choices | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """FieldError naming the field when the shape is wrong (not the grammar's content:
        ``check_grammar`` compiles it)."""
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        try:
            msgspec.convert(self, _Checked, from_attributes=True)
        except msgspec.ValidationError as exc:
            raise invalid(exc, self, StructuredOutputsParams, WHERE) from None
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise FieldError(
                f"{WHERE} must set exactly one of {', '.join(KINDS)}, got "
                f"{', '.join(kinds) or 'none'}",
                field=WHERE,
            )
        if kinds[0] == "json":
            self.json = _schema(self.json)
        if not _surely_within(getattr(self, kinds[0])):
            self._check_size(kinds[0])

    def _check_size(self, kind: str) -> None:
        size = len(self.spec.encode("utf-8", "surrogatepass"))
        if size > MAX_CONSTRAINT_BYTES:
            raise FieldError(
                f"{WHERE}.{kind} is {size} bytes, over the limit of {MAX_CONSTRAINT_BYTES}",
                field=f"{WHERE}.{kind}",
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (what the audit row and the cache key show)."""
        value = getattr(self, self.kind)
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutputsParams | None:
        """The constraint ``data`` (an object of the fields above) describes; FieldError."""
        if data is None or isinstance(data, cls):
            return data
        try:
            return msgspec.convert(data, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise invalid(exc, data, cls, WHERE) from None


def _schema(value: dict[str, Any] | str) -> dict[str, Any]:
    """A JSON schema given as an object or its text, as an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise FieldError(
                f"{WHERE}.json is not valid JSON: {exc}", field=f"{WHERE}.json"
            ) from None
    if not isinstance(value, dict):
        raise FieldError(
            f"{WHERE}.json must be a JSON schema (an object), got {value!r:.60}",
            field=f"{WHERE}.json",
        )
    return value


_Checked = msgspec.defstruct(
    "_CheckedStructuredOutputs",
    [(f.name, f.type) for f in msgspec.structs.fields(StructuredOutputsParams)],
)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's earlier name


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) of ``params``."""
    from llguidance import LLMatcher

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        if params.disable_additional_properties and isinstance(schema, dict):
            schema = _closed(schema)
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options = {"whitespace_pattern": params.whitespace_pattern}
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return LLMatcher.grammar_from_lark(f"start: {literals}\n")
    return LLMatcher.grammar_from_lark(_lark(params.grammar))


def _lark(grammar: str) -> str:
    """Lark as it is; GBNF (``root ::= ...``) converted by llguidance's own converter."""
    if "::=" not in grammar:
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(grammar)
    except Exception as exc:  # noqa: BLE001 - the converter's own errors name the problem
        raise FieldError(f"grammar: {exc}") from None


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with additionalProperties false on every object that does not set it."""
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_any(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def _closed_any(value: Any) -> Any:
    if isinstance(value, dict):
        return _closed(value)
    if isinstance(value, list):
        return [_closed_any(v) for v in value]
    return value


def check_grammar(params: StructuredOutputsParams) -> str:
    """The grammar of ``params``, compiled once; FieldError naming the problem when the
    schema, regex or grammar is one the engine cannot follow."""
    from llguidance import LLMatcher

    grammar = grammar_of(params)
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        text = "; ".join(_clean(m) for m in messages) or "it does not compile"
        raise FieldError(f"structured_outputs.{params.kind}: {text}")
    return grammar


def _clean(message: str) -> str:
    return re.sub(r"\s+", " ", message).strip()[:500]


def _surely_within(value: Any) -> bool:
    """Whether ``value``'s ``spec`` is within ``MAX_CONSTRAINT_BYTES`` without writing it:
    orjson's compact UTF-8 (0.08 ms on a 97 KB schema, where ``json.dumps`` took 1.5 ms of
    the gateway's event loop) is at most three times shorter: a space after each
    separator, ``\\uXXXX`` for two to four bytes of UTF-8, floats as Python writes them
    (``tests/unit/test_structured_params.py`` checks the factor on any JSON value)."""
    if isinstance(value, str | bool):
        return False  # a text (or a flag) is measured as it is, at the cost of its encoding
    try:
        return 3 * len(orjson.dumps(value)) <= MAX_CONSTRAINT_BYTES
    except (orjson.JSONEncodeError, TypeError):  # past 64-bit integers, lone surrogates
        return False
