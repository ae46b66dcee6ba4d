"""What a new grammar's compile costs the other requests of a worker's engine (issue 51
row 2, the worker's door): one unconstrained request decodes while another arrives
with a 500-rule GBNF (inside the default limits) that no cache holds; measured, the
longest gap between the running request's consecutive tokens from that arrival until
the constrained one's first token, and that first token's latency.

Two modes of the same engine, alternated round by round: ``on step`` compiles inside
``add_request`` (the sandbox's round trip and llguidance's compile on the step's
thread, as before ``engine/grammar_wait.py``), ``off step`` in the factory's pool while
the request waits. The engine is built as ``worker.serve`` builds it (a grammar sandbox
of one warm process, the LLTokenizer built first), on a tiny random Llama by default
(its steps take milliseconds, as a GPU's do; SmolLM2's on a loaded 2-core CPU take
seconds, more than the compile itself).

    .venv/bin/python benchmarks/grammar_off_step.py [--model DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lorapool import EngineArgs, LLMEngine, SamplingParams
from lorapool.grammar_sandbox import GrammarSandbox
from lorapool.records.structured import StructuredOutputsParams as S

ROOT = Path(__file__).resolve().parents[1]
PLAIN = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)


def grammar(tag: str) -> S:
    rules = "".join(f'r{k} ::= r{k + 1} "a"\n' for k in range(500))
    return S(grammar=f'root ::= r0\n{rules}r500 ::= "{tag}"\n')


def tiny_llama(path: Path) -> str:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from tiny_models import build_tiny_model
    from tiny_tokenizer import build_tiny_tokenizer

    build_tiny_model("llama", path)
    build_tiny_tokenizer(path, vocab_size=512)
    return str(path)


def one_round(engine: LLMEngine, tag: str) -> tuple[float, float, float]:
    """(max token gap while the grammar compiles, its request's first-token latency,
    the max gap of the 8 tokens before it arrived), seconds."""
    engine.add_request(f"plain-{tag}", "Tell me a story", PLAIN)
    times = []
    while len(times) < 8:
        times += [time.perf_counter() for o in engine.step() if o.request_id == f"plain-{tag}"]
    before = max(b - a for a, b in zip(times, times[1:]))
    params = SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=grammar(tag))
    added = time.perf_counter()
    engine.add_request(f"guided-{tag}", "Hi", params)
    during, first = [times[-1]], None
    while first is None:
        for out in engine.step():
            if out.request_id == f"plain-{tag}":
                during.append(time.perf_counter())
            elif out.request_id == f"guided-{tag}":
                first = time.perf_counter() - added
    engine.abort_request([f"plain-{tag}", f"guided-{tag}"])
    while engine.has_unfinished_requests():
        engine.step()
    return max(b - a for a, b in zip(during, during[1:])), first, before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: a tiny Llama, built)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    model = args.model or tiny_llama(Path(tempfile.mkdtemp()) / "tiny-llama")
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=8))
    engine.guides.sandbox = GrammarSandbox(size=1)
    engine.guides.guide(S(regex="warm"))  # the LLTokenizer, a sandbox process started
    off_step = engine.guides.submit
    results: dict[str, list[tuple[float, float, float]]] = {"on step": [], "off step": []}
    for i in range(args.rounds):
        for mode in ("on step", "off step") if i % 2 == 0 else ("off step", "on step"):
            engine.guides.submit = off_step if mode == "off step" else (lambda params: None)
            results[mode].append(one_round(engine, f"{mode[:2]}{i}"))
    engine.guides.close()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds per mode, alternated")
    print("mode      | max gap while compiling | first token of the grammar | max gap before")
    for mode, rows in results.items():
        gap, first, before = (statistics.median(col) * 1e3 for col in zip(*rows))
        print(f"{mode:9} | {gap:18.0f} ms | {first:21.0f} ms | {before:12.0f} ms")


if __name__ == "__main__":
    main()
