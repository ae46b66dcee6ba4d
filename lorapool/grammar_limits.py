"""Limits on a structured output's shape, checked before anything compiles it.

llguidance's compiler recurses on a grammar's structure: a Lark chain of 3,000 rules
or a JSON schema whose ``$ref`` chain is 3,000 ``$defs`` long overflows its native
stack and kills the process (SIGSEGV, issue 51 row 1), and a GBNF of 3,000 rules
takes seconds (row 2). These limits are counted in pure Python (no llguidance, no
torch) in time linear in the constraint, so every door (gateway routes, batch
validation, the worker's own compile) refuses such a constraint with a message that
names the limit before any compiler sees it. What passes them still compiles in a
sandbox subprocess first (``lorapool.grammar_sandbox``).

Defaults (``GrammarLimits``) sit well under what crashed or ran long on a 2-core CPU
VM (a 1,000-rule Lark chain and a 1,000-deep ``$ref`` chain compile in ~0.1 s; 3,000
crash; a 500-rule GBNF validates in ~0.3 s, a 3,000-rule one in 4.5 s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from lorapool.records.errors import FieldError

WHERE = "structured_outputs"
MAX_DEPTH = 256  # the most a depth limit may be set to


@dataclass(frozen=True)
class GrammarLimits:
    """max_grammar_rules: rules and terminals of a Lark or GBNF grammar.
    max_grammar_depth: nesting of parentheses/brackets in a grammar or a regex.
    max_schema_refs: ``$ref`` occurrences in a JSON schema.
    max_ref_depth: the longest chain of ``$ref`` to a schema that holds a ``$ref``…
    max_schema_depth: nesting of objects and arrays in a JSON schema.
    max_enum_values: values of one ``enum`` (and choices of a ``choice``).
    max_regex_chars: characters of a regex (``regex``, a schema's ``pattern``, a
    ``whitespace_pattern``).
    compile_timeout_s: seconds the sandbox may compile one constraint.
    compile_memory_mb: address space of a sandbox process (MiB)."""

    max_grammar_rules: int = 512
    max_grammar_depth: int = 64
    max_schema_refs: int = 256
    max_ref_depth: int = 32
    max_schema_depth: int = 64
    max_enum_values: int = 1024
    max_regex_chars: int = 4096
    compile_timeout_s: float = 10.0
    compile_memory_mb: int = 2048

    def __post_init__(self):
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"grammar limit {f.name} must be above 0")
        for name in ("max_ref_depth", "max_schema_depth", "max_grammar_depth"):
            if getattr(self, name) > MAX_DEPTH:  # the checks recurse that deep
                raise ValueError(f"grammar limit {name} must be at most {MAX_DEPTH}")

    @classmethod
    def parse(cls, items: tuple[str, ...] | list[str]) -> GrammarLimits:
        """From ``NAME=VALUE`` items (the CLI's ``--grammar-limit``); ValueError naming
        an unknown name or a bad value."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for item in items:
            name, _, value = item.partition("=")
            name = name.strip().replace("-", "_")
            if name not in known:
                raise ValueError(f"unknown grammar limit {name!r}; one of {', '.join(known)}")
            try:
                values[name] = float(value) if known[name] == "float" else int(value)
            except ValueError:
                raise ValueError(f"grammar limit {name} needs a number, got {value!r}") from None
        return cls(**values)


DEFAULT_LIMITS = GrammarLimits()


def _over(what: str, count: int, name: str, limit: int, field: str) -> FieldError:
    return FieldError(
        f"{WHERE}.{field}: {what} is {count}, over the limit {name}={limit}",
        field=f"{WHERE}.{field}",
    )


def check_structure(params, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """FieldError naming the limit that ``params`` (a ``StructuredOutputsParams``) passes;
    nothing is compiled."""
    kind = params.kind
    if params.whitespace_pattern is not None:
        _regex(params.whitespace_pattern, limits, "whitespace_pattern")
    if kind == "grammar":
        _grammar(params.grammar, limits)
    elif kind == "regex":
        _regex(params.regex, limits, "regex")
    elif kind == "choice" and len(params.choice) > limits.max_enum_values:
        raise _over("the number of choices", len(params.choice), "max_enum_values",
                    limits.max_enum_values, "choice")  # fmt: skip
    elif kind == "json":
        _Schema(limits).check(params.json)


_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.]*(?:[ \t]*\.[ \t]*-?\d+)?[ \t]*:(?!:)", re.M)
_GBNF_RULE = re.compile(r"::=")


def _grammar(text: str, limits: GrammarLimits) -> None:
    rules = len(_GBNF_RULE.findall(text)) if "::=" in text else len(_RULE.findall(text))
    rules += text.count("%json")  # inline schemas are grammars of their own
    if rules > limits.max_grammar_rules:
        raise _over("the number of rules", rules, "max_grammar_rules",
                    limits.max_grammar_rules, "grammar")  # fmt: skip
    depth = _nesting(text)
    if depth > limits.max_grammar_depth:
        raise _over("the nesting of brackets", depth, "max_grammar_depth",
                    limits.max_grammar_depth, "grammar")  # fmt: skip


def _regex(text: str, limits: GrammarLimits, field: str) -> None:
    if len(text) > limits.max_regex_chars:
        raise _over("the length of the regex", len(text), "max_regex_chars",
                    limits.max_regex_chars, field)  # fmt: skip
    depth = _nesting(text)
    if depth > limits.max_grammar_depth:
        raise _over("the nesting of brackets", depth, "max_grammar_depth",
                    limits.max_grammar_depth, field)  # fmt: skip


def _nesting(text: str) -> int:
    """The deepest nesting of ( [ { in ``text`` (quoted or escaped ones too: a bound)."""
    depth = deepest = 0
    for c in re.findall(r"[()\[\]{}]", text):
        depth = depth + 1 if c in "([{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


class _Schema:
    """One pass over a JSON schema: nesting, ``$ref`` count, enum sizes, patterns; then
    the longest ``$ref`` chain through the schemas they point at."""

    def __init__(self, limits: GrammarLimits):
        self.limits = limits
        self.refs: list[tuple[tuple, str]] = []  # (path of the schema holding it, target)

    def check(self, schema: Any) -> None:
        self._walk(schema, (), 0)
        self._chain(schema)

    def _walk(self, value: Any, path: tuple, depth: int) -> None:
        limits = self.limits
        if depth > limits.max_schema_depth:
            raise _over("the nesting of the schema", depth, "max_schema_depth",
                        limits.max_schema_depth, "json")  # fmt: skip
        if isinstance(value, list):
            for i, item in enumerate(value):
                self._walk(item, (*path, i), depth + 1)
            return
        if not isinstance(value, dict):
            return
        self._node(value, path)
        for key, item in value.items():
            if isinstance(item, (dict, list)):
                self._walk(item, (*path, key), depth + 1)

    def _node(self, node: dict, path: tuple) -> None:
        limits = self.limits
        ref = node.get("$ref")
        if isinstance(ref, str):
            self.refs.append((path, ref))
            if len(self.refs) > limits.max_schema_refs:
                raise _over("the number of $ref", len(self.refs), "max_schema_refs",
                            limits.max_schema_refs, "json")  # fmt: skip
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > limits.max_enum_values:
            raise _over("the size of an enum", len(enum), "max_enum_values",
                        limits.max_enum_values, "json")  # fmt: skip
        for key in ("pattern", "patternProperties"):
            if isinstance(node.get(key), str):
                _regex(node[key], limits, "json")
            elif isinstance(node.get(key), dict):
                for pattern in node[key]:
                    _regex(pattern, limits, "json")

    def _chain(self, schema: Any) -> None:
        """The longest chain ref -> a schema holding a ref -> ... (a cycle counts once)."""
        targets: dict[tuple, list[tuple]] = {}  # a schema's path -> paths its refs name
        for path, ref in self.refs:
            target = _pointer(ref)
            if target is not None:
                targets.setdefault(path, []).append(target)
        depth: dict[tuple, int] = {}
        for start in list(targets):
            self._longest(start, targets, depth, set())

    def _longest(self, node: tuple, targets: dict, depth: dict, stack: set) -> int:
        if node in depth:
            return depth[node]
        if node in stack:  # a recursive schema: its cycle is not a chain
            return 0
        if len(stack) >= self.limits.max_ref_depth:
            raise _over("the length of a $ref chain", len(stack) + 1, "max_ref_depth",
                        self.limits.max_ref_depth, "json")  # fmt: skip
        stack.add(node)
        best = 0
        for target in targets.get(node, ()):
            inner = [p for p in targets if p[: len(target)] == target]
            best = max([best, 1, *(1 + self._longest(p, targets, depth, stack) for p in inner)])
        stack.discard(node)
        depth[node] = best
        return best


def _pointer(ref: str) -> tuple | None:
    """``#/$defs/a/properties/b`` as a path; None for any other form (remote refs)."""
    if not ref.startswith("#"):
        return None
    parts = [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p]
    return tuple(int(p) if p.isdigit() else p for p in parts)
