"""What the grammar sandbox costs a request (issue 51 Build 1: "measure the cost per
request"): a constraint checked in this process (``check_grammar``, what the gateway did
before) against the same one sent to a warm sandbox process (``GrammarSandbox.check``:
the limits counted, a round trip, the compile there) and against a cached verdict; and
what the worker's engine then pays compiling it with the tokenizer (``LLMatcher``), for a
small schema and for grammars at the default rule limit.

    .venv/bin/python benchmarks/grammar_sandbox.py [--tokenizer DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from lorapool.grammar_limits import check_structure
from lorapool.grammar_sandbox import GrammarSandbox
from lorapool.records.structured import StructuredOutputsParams as P
from lorapool.records.structured import check_grammar, grammar_of

SMOLLM2 = "/root/.cache/lorapool/models/SmolLM2-135M-Instruct"


def cases(i: int) -> dict[str, P]:
    """Each constraint made unique by ``i`` (no cache helps)."""
    schema = {"type": "object", "properties": {f"a{i}": {"type": "integer"},
              "b": {"type": "string", "maxLength": 20}}, "required": [f"a{i}"]}  # fmt: skip
    gbnf = "root ::= r0\n" + "".join(f'r{k} ::= r{k + 1} "a"\n' for k in range(500))
    lark = "start: r0\n" + "".join(f"r{k}: r{k + 1}\n" for k in range(500))
    return {
        "json schema (2 fields)": P(json=schema),
        "GBNF 500 rules": P(grammar=gbnf + f'r500 ::= "x{i}"\n'),
        "Lark chain 500 rules": P(grammar=lark + f'r500: "x{i}"\n'),
    }


def ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.2f}"


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=SMOLLM2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from llguidance import LLMatcher
    from llguidance.hf import from_tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    lltok = from_tokenizer(hf)
    sandbox = GrammarSandbox()
    sandbox.check(P(regex="warm"))  # the process started and warm
    names = list(cases(0))
    rows = {n: {"limits": [], "in-process": [], "sandbox": [], "cached": [], "engine": []}
            for n in names}  # fmt: skip
    for r in range(args.rounds):
        for name, params in cases(r + 1).items():
            row = rows[name]
            row["limits"].append(timed(check_structure, params))
            row["in-process"].append(timed(check_grammar, params))
            row["sandbox"].append(timed(sandbox.check, params))
            row["cached"].append(timed(sandbox.check, params))
            row["engine"].append(timed(LLMatcher, lltok, grammar_of(params)))
    sandbox.close()
    print("| constraint | limits counted (ms) | compiled in-process (ms) | sandbox, fresh (ms) "
          "| sandbox, cached (ms) | engine LLMatcher with SmolLM2's tokenizer (ms) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name in names:
        row = rows[name]
        cells = " | ".join(
            ms(row[k]) for k in ("limits", "in-process", "sandbox", "cached", "engine")
        )
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
