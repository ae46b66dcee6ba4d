"""Structured outputs: the constraint one request's completions must follow (vLLM's
``StructuredOutputsParams``), its checks, and the grammar it compiles to.

Torch-free, and free of the grammar engine at import: a producer builds and sends
constraints without it. ``grammar_of`` turns one into the grammar of llguidance
(the engine the worker masks tokens with, ``lorapool.engine.guide``), and
``check_grammar`` compiles that grammar once to refuse a bad schema, regex or
grammar with a message naming the problem (the gateway, before it enqueues).

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
from dataclasses import asdict, dataclass, fields
from typing import Any

from lorapool.protocol import FieldError, short_repr

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CONSTRAINT_BYTES = 256 << 10  # a schema, regex, grammar or the choices, encoded
MAX_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    """What a request's completions must match (vLLM's fields; one kind at a time)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """FieldError naming the field when the shape is wrong (not the grammar's content:
        ``check_grammar`` compiles it)."""
        where = "sampling_params.structured_outputs"
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise FieldError(
                f"{where} must set exactly one of {', '.join(KINDS)}, got "
                f"{', '.join(kinds) or 'none'}"
            )
        self._verify_kind(where, kinds[0])
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(f"{where}.{name} must be true or false")
        if not (self.whitespace_pattern is None or isinstance(self.whitespace_pattern, str)):
            raise FieldError(f"{where}.whitespace_pattern must be a string")
        size = len(self.spec.encode("utf-8", "surrogatepass"))
        if size > MAX_CONSTRAINT_BYTES:
            raise FieldError(
                f"{where}.{kinds[0]} is {size} bytes, over the limit of {MAX_CONSTRAINT_BYTES}"
            )

    def _verify_kind(self, where: str, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise FieldError(f"{where}.json is not valid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise FieldError(f"{where}.json must be a JSON schema, got {short_repr(value)}")
            self.json = value
        elif kind == "choice":
            if not (isinstance(value, (list, tuple)) and 0 < len(value) <= MAX_CHOICES):
                raise FieldError(
                    f"{where}.choice must be a list of 1 to {MAX_CHOICES} strings, "
                    f"got {short_repr(value)}"
                )
            if not all(isinstance(c, str) and c for c in value):
                raise FieldError(f"{where}.choice must hold non-empty strings")
            self.choice = list(value)
        elif kind == "json_object":
            if value is not True:
                raise FieldError(f"{where}.json_object must be true, got {short_repr(value)}")
        elif not (isinstance(value, str) and value):
            raise FieldError(f"{where}.{kind} must be a non-empty string, got {short_repr(value)}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (what the audit row and the cache key show)."""
        value = getattr(self, self.kind)
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutputsParams | None:
        if data is None or isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise FieldError(
                f"sampling_params.structured_outputs must be an object, got {short_repr(data)}"
            )
        unknown = sorted(map(str, set(data) - {f.name for f in fields(cls)}))
        if unknown:
            raise FieldError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
        return cls(**data)


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
