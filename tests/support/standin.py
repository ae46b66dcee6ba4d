"""The benchmark's engine stand-in (benchmarks/queue_gpu.py), for tests that drive the
real worker at GPU step rates: ``StandInEngine``, ``token_of`` (its output, the
tests' oracle), ``AUDIT_KEY`` and ``BASE_MODEL``."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "queue_gpu.py"


def load():
    spec = importlib.util.spec_from_file_location("lorapool_bench_queue_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
