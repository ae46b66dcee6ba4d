"""Kernel tests: Triton kernels under the interpreter, checked against the reference.

Triton chooses between compiling and interpreting once per process
(``lorapool.kernels.jit``), so the kernel tests that launch kernels on the CPU
run in a process of their own, started with ``TRITON_INTERPRET=1``:

    pytest                                    # everything else (kernel compile tests too)
    TRITON_INTERPRET=1 pytest tests/kernels   # the tests marked ``interpret``

``make test`` runs both. A test is marked ``interpret`` when it asks for the
``triton_interpret`` fixture or says so itself; in the other process it is
skipped with the command that runs it, and the unmarked kernel tests are skipped
in the interpreting one, so each runs once. In the interpreting process every
test starts with the variable unset, so the dispatch takes the reference path
until the test (or ``triton_interpret``) sets it.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

INTERPRETING_PROCESS = os.environ.get("TRITON_INTERPRET") == "1"  # as the process started
HERE = Path(__file__).parent

if importlib.util.find_spec("triton") is None:  # e.g. macOS: the kernels need Triton
    collect_ignore_glob = ["test_*.py"]
elif INTERPRETING_PROCESS:
    # Jit every kernel now, interpreted, before any test unsets the variable.
    from lorapool.kernels import (  # noqa: F401
        activation_ops,
        attention_ops,
        kv_cache_ops,
        lora_ops,
        norm_ops,
        rotary_ops,
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE not in Path(str(item.fspath)).parents:
            continue
        if "triton_interpret" in item.fixturenames:
            item.add_marker(pytest.mark.interpret)
        marked = item.get_closest_marker("interpret") is not None
        if marked and not INTERPRETING_PROCESS:
            item.add_marker(
                pytest.mark.skip(
                    reason="launches kernels on the CPU: runs in a process started with "
                    "TRITON_INTERPRET=1 (`TRITON_INTERPRET=1 pytest tests/kernels`; make test does)"
                )
            )
        elif not marked and INTERPRETING_PROCESS:
            item.add_marker(
                pytest.mark.skip(reason="runs in the test process without TRITON_INTERPRET")
            )


# Tolerances of a kernel against the fp32 reference, by the dtype of the data.
TOLERANCES = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


@pytest.fixture(autouse=True)
def _reference_dispatch(monkeypatch):
    """In the interpreting process, tests start on the reference path."""
    if INTERPRETING_PROCESS:
        monkeypatch.delenv("TRITON_INTERPRET")


@pytest.fixture
def triton_interpret(monkeypatch, _reference_dispatch):
    """Sends the test's kernel calls on CPU tensors to the Triton kernels (interpreted)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def tolerances():
    return TOLERANCES
