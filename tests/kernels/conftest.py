"""Kernel tests: Triton kernels under the interpreter, checked against the reference.

The ``triton_interpret`` fixture sets ``TRITON_INTERPRET=1`` for one test only;
the dispatch and ``kernels.jit.Kernel`` read it at call time, so tests in other
directories of the same pytest run keep the CPU reference path.
"""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # e.g. macOS: the kernels need Triton
    collect_ignore_glob = ["test_*.py"]

# Tolerances of a kernel against the fp32 reference, by the dtype of the data.
TOLERANCES = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


@pytest.fixture
def triton_interpret(monkeypatch):
    """Runs the test's kernel calls through Triton's interpreter on the CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def tolerances():
    return TOLERANCES
