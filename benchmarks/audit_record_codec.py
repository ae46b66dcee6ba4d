"""An audit record's own cost: the worker's encode, the writer's parse (issue 36, helper 73).

Per record, best of ``--repeat`` passes over 2,000 varied signed records
(``tests/support/audit_fixtures.random_records``): ``parse_record`` (decode, check
the signature, validate: the audit writer's parse since issue 50; before, the writer had
its own, ``audit_db.decoder.parse``, measured where a base build has one), and the
worker's ``record_from_output`` + signed bytes of a finished 2-completion request.
With ``--base DIR`` (``lorapool/records/audit.py`` and ``audit_db/decoder.py`` of an
earlier build, ``git show REV:PATH``, put in DIR) the same operations of that build
run too, alternated with this build's in one process, so both meet the same load:

    mkdir /tmp/base && git show 7b272de:lorapool/audit_record.py > /tmp/base/audit_record.py
    git show 7b272de:audit_db/decoder.py > /tmp/base/decoder.py
    python benchmarks/audit_record_codec.py --base /tmp/base [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path
from types import ModuleType

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from audit_fixtures import random_records  # noqa: E402

from lorapool import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from lorapool.records import audit as audit_record  # noqa: E402
from lorapool.records.adapter import ModelIdentity  # noqa: E402

KEY, POOL = b"k" * 40, "pool"
BASE_MODEL = ModelIdentity("smol", "cd" * 32)
ADAPTER = {
    **{"name": "sql-lora", "id": 3, "path": "/adapters/sql/v2", "sha256": "ab" * 32},
    **{"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"], "base_model": "smol"},
}


def _load(name: str, path: Path, replace: tuple[str, str] | None = None) -> ModuleType:
    source = path.read_text()
    if replace is not None:
        source = source.replace(*replace)
    module = ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up while decorating
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def _finished() -> RequestOutput:
    metrics = RequestMetrics(1.7e9, 1.7e9 + 0.01, 1.7e9 + 0.05, 1.7e9 + 2, 1.7e9 + 2, 0.01, 16, 96)
    outputs = [
        CompletionOutput(k, " the" * 48, list(range(1000, 1048)), -20.5, None, "stop", None)
        for k in range(2)
    ]
    prompt_ids = list(range(16))
    return RequestOutput("r-1", "say hi " * 8, prompt_ids, None, outputs, True, metrics=metrics)


def operations(record_module: ModuleType, decoder_module: ModuleType | None) -> dict:
    payloads = [
        orjson.dumps(record_module.sign_record(r, KEY, POOL)) for r in random_records(2000, seed=1)
    ]
    output, parse = _finished(), record_module.parse_record

    def encode():
        record = record_module.record_from_output(
            output,
            worker="w-1",
            base_model=BASE_MODEL,
            adapter=ADAPTER,
            sampling_params={"temperature": 0.7, "max_tokens": 48, "n": 2},
            metadata={"tenant": "acme"},
        )
        return orjson.dumps(record_module.sign_record(record, KEY, POOL))

    found = {
        "parse_record (signed)": (lambda: [parse(p, KEY, POOL) for p in payloads], len(payloads)),
        "record_from_output + signed bytes": (lambda: [encode() for _ in range(2000)], 2000),
    }
    if decoder_module is not None:  # a build whose writer had a decoder of its own
        fast = decoder_module.parse
        found["decoder.parse (the writer's)"] = (
            lambda: [fast(p, KEY, POOL) for p in payloads],
            len(payloads),
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="a folder with an earlier build's modules")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    builds = {"head": operations(audit_record, None)}
    if args.base is not None:
        base = _load("base_audit_record", args.base / "audit_record.py")
        base_decoder = _load(
            "base_decoder",
            args.base / "decoder.py",
            ("from lorapool.records.audit import", "from base_audit_record import"),
        )
        builds["base"] = operations(base, base_decoder)
    times: dict = {}
    for round_ in range(args.rounds):
        for build in list(builds)[:: 1 if round_ % 2 else -1]:  # alternate who goes first
            for name, (run, count) in builds[build].items():
                best = min(timeit.repeat(run, number=1, repeat=args.repeat)) / count
                times.setdefault((name, build), []).append(best * 1e6)
    for (name, build), values in sorted(times.items()):
        print(f"{name:36} {build:5} median {statistics.median(values):6.2f} µs/record", end="")
        print("  runs " + ", ".join(f"{v:.2f}" for v in values))


if __name__ == "__main__":
    main()
