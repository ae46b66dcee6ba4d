"""Grammar engines for structured outputs, measured on the pool's tokenizers (CPU).

For each engine installed (llguidance, xgrammar, outlines-core) and each tokenizer
(SmolLM2-135M-Instruct's 49,152 tokens, the tests' tiny 512-token BPE): the time to
prepare the tokenizer, to compile a JSON schema, a regex and a choice, and the cost
of one token mask (fill the next-token bitmask, then advance by one token), over
random walks that draw each token uniformly among the allowed ones until the
grammar ends. Correctness: every walk's text must parse and validate against the
constraint (pydantic for the schema, ``re.fullmatch`` for the regex); an engine
that lets a walk produce an invalid text, or blocks it, is counted as a failure.

    python benchmarks/grammar.py [--walks 20] [--engines llguidance,xgrammar,outlines]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))


class Pet(BaseModel):
    model_config = {"extra": "forbid"}
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=150)
    kind: Literal["cat", "dog", "bird"]
    tags: list[str] = Field(max_length=3)
    vaccinated: bool


SCHEMA = Pet.model_json_schema()
for _p in SCHEMA["properties"].values():  # short strings: a random walk ends in a bounded text
    if _p.get("type") == "array":
        _p["items"]["maxLength"] = 8
REGEX = r"[0-9]{3}-[a-z]{2,5}(\.[a-z]{2,3})?"
CHOICES = ["positive", "negative", "neutral"]
MAX_WALK = 300


def check(kind: str, text: str) -> bool:
    try:
        if kind == "json":
            pet = Pet.model_validate_json(text)
            return all(len(t) <= 8 for t in pet.tags)
        if kind == "regex":
            return re.fullmatch(REGEX, text) is not None
        return text in CHOICES
    except ValueError:
        return False


# --- engines: prepare(tokenizer) -> compile(kind) -> matcher: (fill, advance, done) ---


class Llguidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int):
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)

    def compile(self, kind: str):
        M = self.ll.LLMatcher
        if kind == "json":
            grammar = M.grammar_from_json_schema(
                json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
            )
        elif kind == "regex":
            grammar = M.grammar_from_regex(REGEX)
        else:
            grammar = M.grammar_from_regex("|".join(re.escape(c) for c in CHOICES))
        return grammar

    def matcher(self, grammar):
        m = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, m, mask) -> None:
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)

    def advance(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, kind: str):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(REGEX)
        return self.compiler.compile_regex("|".join(re.escape(c) for c in CHOICES))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, mask) -> None:
        m.fill_next_token_bitmask(mask.view(1, -1))

    def advance(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


class Outlines:
    name = "outlines-core"

    def __init__(self, hf, vocab: int):
        import outlines_core

        self.oc = outlines_core
        self.vocabulary = outlines_core.Vocabulary(hf.eos_token_id, _byte_vocab(hf))
        self.eos = hf.eos_token_id

    def compile(self, kind: str):
        from outlines_core.json_schema import build_regex_from_schema

        if kind == "json":
            regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
        elif kind == "regex":
            regex = REGEX
        else:
            regex = "|".join(re.escape(c) for c in CHOICES)
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, index):
        return self.oc.Guide(index)

    def fill(self, m, mask) -> None:
        m.write_mask_into(mask.data_ptr(), mask.numel(), 4)

    def advance(self, m, token: int) -> bool:
        if token == self.eos:
            self._ended = True
            return True
        m.advance(token)
        return True

    def done(self, m) -> bool:
        return m.is_finished()


def _byte_vocab(hf) -> dict[bytes, list[int]]:
    """Token -> ids with each token's bytes (byte-level BPE: GPT-2's byte alphabet)."""
    decode = {c: b for b, c in _bytes_to_unicode().items()}
    vocab: dict[bytes, list[int]] = {}
    special = set(hf.all_special_ids)
    for token, i in hf.get_vocab().items():
        if i in special:
            continue
        try:
            raw = bytes(decode[c] for c in token)
        except KeyError:
            raw = token.encode()
        vocab.setdefault(raw, []).append(i)
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


ENGINES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines": Outlines}


def walk(engine, grammar, hf, vocab: int, rng: random.Random, eos: int):
    """One random walk: (text, per-token mask seconds, tokens, ended properly)."""
    import torch

    m = engine.matcher(grammar)
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    bits = torch.arange(32, dtype=torch.int32)
    tokens, times = [], []
    for _ in range(MAX_WALK):
        t0 = time.perf_counter()
        engine.fill(m, mask)
        times.append(time.perf_counter() - t0)
        allowed = ((mask.unsqueeze(-1) >> bits) & 1).flatten()[:vocab].nonzero().flatten()
        if len(allowed) == 0:
            return hf.decode(tokens), times, len(tokens), False
        token = int(allowed[rng.randrange(len(allowed))])
        if token == eos:
            return hf.decode(tokens), times, len(tokens), True
        t0 = time.perf_counter()
        ok = engine.advance(m, token)
        times[-1] += time.perf_counter() - t0
        if not ok:
            return hf.decode(tokens), times, len(tokens), False
        tokens.append(token)
    return hf.decode(tokens), times, len(tokens), False


def measure(engine_cls, hf, vocab: int, walks: int) -> dict:
    t0 = time.perf_counter()
    engine = engine_cls(hf, vocab)
    result = {"engine": engine_cls.name, "prepare_s": round(time.perf_counter() - t0, 3)}
    for kind in ("json", "regex", "choice"):
        t0 = time.perf_counter()
        grammar = engine.compile(kind)
        compile_s = time.perf_counter() - t0
        rng, times, bad, lengths, failures = random.Random(0), [], 0, [], []
        for _ in range(walks):
            text, t, n, ended = walk(engine, grammar, hf, vocab, rng, hf.eos_token_id)
            times += t
            lengths.append(n)
            ok = ended and check(kind, text)
            bad += not ok
            if not ok and len(failures) < 3:
                failures.append(text[-80:])
        result[kind] = {
            "compile_ms": round(compile_s * 1e3, 2),
            "mask_us_mean": round(statistics.fmean(times) * 1e6, 1),
            "mask_us_p50": round(statistics.median(times) * 1e6, 1),
            "mask_us_p99": round(sorted(times)[int(0.99 * (len(times) - 1))] * 1e6, 1),
            "tokens_mean": round(statistics.fmean(lengths), 1),
            "invalid_or_blocked": bad,
            "walks": walks,
        }
        if failures:
            result[kind]["failures"] = failures
    return result


def tokenizers(which: list[str]):
    from transformers import AutoTokenizer

    if "tiny" in which:
        from tiny_tokenizer import build_tiny_tokenizer

        path = build_tiny_tokenizer(Path(tempfile.mkdtemp()) / "tiny")
        yield "tiny (512)", AutoTokenizer.from_pretrained(path)
    if "smollm2" in which:
        from lorapool.cli.prepare import prepare_smollm2

        yield "SmolLM2 (49152)", AutoTokenizer.from_pretrained(prepare_smollm2(progress=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--tokenizers", default="tiny,smollm2")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    results = []
    for label, hf in tokenizers(args.tokenizers.split(",")):
        vocab = len(hf)
        for name in args.engines.split(","):
            try:
                row = measure(ENGINES[name], hf, vocab, args.walks)
            except ImportError as exc:
                print(f"{name}: not installed ({exc})")
                continue
            row["tokenizer"] = label
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
