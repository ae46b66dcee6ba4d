"""Structured outputs' shape limits (issue 51 rows 1-2) and the compile sandbox: each
limit refused with a message naming it, before llguidance sees the constraint; a
grammar that crashes or outlasts the compiler costs a sandbox process, not the caller.
The oracle for "crashes" is llguidance itself: the same grammar compiled in a plain child
process dies of SIGSEGV (checked here, so the test says when a fixed llguidance no
longer crashes on it)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from hostile_grammars import gbnf, lark_chain, ref_chain

from lorapool.grammar_limits import GrammarLimits, check_structure
from lorapool.grammar_sandbox import GrammarSandbox
from lorapool.records.errors import FieldError
from lorapool.records.structured import StructuredOutputsParams as P
from lorapool.records.structured import grammar_of


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


OVER = [
    (P(grammar=lark_chain(3000)), "max_grammar_rules=512"),
    (P(grammar=gbnf(1000)), "max_grammar_rules=512"),
    (P(grammar="start: " + "(" * 100 + '"x"' + ")" * 100), "max_grammar_depth=64"),
    (P(json=ref_chain(3000)), "max_schema_refs=256"),
    (P(json=ref_chain(40)), "max_ref_depth=32"),
    (P(json=nested(40)), "max_schema_depth=64"),
    (P(json={"enum": list(range(2000))}), "max_enum_values=1024"),
    (P(json={"type": "string", "pattern": "a" * 5000}), "max_regex_chars=4096"),
    (P(regex="a" * 5000), "max_regex_chars=4096"),
    (P(regex="(" * 100 + "a" + ")" * 100), "max_grammar_depth=64"),
]


@pytest.mark.parametrize("params, limit", OVER)
def test_each_limit_is_refused_naming_it(params, limit):
    with pytest.raises(FieldError, match=limit):
        check_structure(params)


WITHIN = [
    P(grammar=lark_chain(400)),
    P(grammar=gbnf(400)),
    P(json=ref_chain(20)),
    P(json=nested(20)),
    P(
        json={
            "$defs": {
                "t": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                }
            },
            "$ref": "#/$defs/t",
        }
    ),  # fmt: skip
    P(json={"enum": list(range(1000))}),
    P(regex="[a-z]{1,8}@example\\.com"),
]


@pytest.mark.parametrize("params", WITHIN)
def test_what_is_within_the_limits_passes_and_compiles(params):
    check_structure(params)
    sandbox = GrammarSandbox()
    try:
        sandbox.check(params)
    finally:
        sandbox.close()


def test_limits_parse_from_the_command_line_and_name_what_is_wrong():
    assert GrammarLimits.parse(["max_grammar_rules=10", "compile-timeout-s=2.5"]) == GrammarLimits(
        max_grammar_rules=10, compile_timeout_s=2.5
    )
    with pytest.raises(ValueError, match="unknown grammar limit 'max_rules'"):
        GrammarLimits.parse(["max_rules=1"])
    with pytest.raises(ValueError, match="needs a number"):
        GrammarLimits.parse(["max_enum_values=lots"])
    with pytest.raises(ValueError, match="above 0"):
        GrammarLimits(max_schema_refs=0)


def _crashes_llguidance(grammar: str) -> bool:
    code = (
        "import sys; from lorapool.records.structured import StructuredOutputsParams, "
        "check_grammar; "
        "check_grammar(StructuredOutputsParams(grammar=sys.stdin.read()))"
    )
    run = subprocess.run([sys.executable, "-c", code], input=grammar.encode(), capture_output=True)
    return run.returncode == -signal.SIGSEGV


def test_a_grammar_that_crashes_llguidance_costs_a_sandbox_process():
    grammar = lark_chain(3000)
    assert _crashes_llguidance(grammar), "llguidance no longer crashes on this grammar"
    sandbox = GrammarSandbox(GrammarLimits(max_grammar_rules=10_000))
    try:
        for _ in range(2):  # the second: the cached verdict
            with pytest.raises(FieldError, match="crashed"):
                sandbox.check(P(grammar=grammar))
        sandbox.check(P(grammar=lark_chain(10)))  # a fresh process took its place
        assert sandbox.stats["crashes"] == 1 and sandbox.stats["cached"] == 1
    finally:
        sandbox.close()


def test_a_compile_past_its_time_is_killed_and_named():
    sandbox = GrammarSandbox(GrammarLimits(max_grammar_rules=10_000, compile_timeout_s=0.5))
    try:
        with pytest.raises(FieldError, match="compile_timeout_s=0.5"):
            sandbox.check(P(grammar=gbnf(3000)))  # seconds of compile
        assert sandbox.stats["timeouts"] == 1
        sandbox.check(P(regex="a+"))
    finally:
        sandbox.close()


def test_a_cached_verdict_still_gives_the_grammar_to_a_caller_that_needs_it():
    """The worker's engine, whose compiled grammar left its cache, gets the grammar's text
    from the sandbox again (converted there, as llguidance's own converter makes it),
    never converting a GBNF on its own threads; a refusal stays cached."""
    params = P(grammar=gbnf(40))
    sandbox = GrammarSandbox()
    try:
        first = sandbox.check(params)
        assert sandbox.check(params) is None  # the gateway's: the verdict alone
        assert sandbox.check(params, grammar=True) == first == grammar_of(params)
        assert sandbox.stats["compiles"] == 2
        bad = P(grammar="root ::= missing")
        for _ in range(2):
            with pytest.raises(FieldError, match="missing"):
                sandbox.check(bad, grammar=True)
        assert sandbox.stats["compiles"] == 3
    finally:
        sandbox.close()
