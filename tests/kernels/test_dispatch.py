"""Dispatch: which path an op takes, and that interpreter mode never leaks out of a test."""

import os
import subprocess
import sys

import pytest
import torch

from lorapool import kernels
from lorapool.kernels import (
    activation_ops,
    attention_ops,
    kv_cache_ops,
    lora_ops,
    norm_ops,
    reference,
    rotary_ops,
)

triton = pytest.importorskip("triton", reason="Triton is not installed")


def _fail(*args, **kwargs):
    raise AssertionError("the Triton path was taken")


def test_use_triton_reads_the_variable_at_call_time(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.use_triton(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.use_triton(cpu)


def test_cpu_tensors_take_the_reference_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for module, names in (
        (lora_ops, ("lora_shrink", "lora_expand")),
        (attention_ops, ("paged_attention",)),
        (kv_cache_ops, ("write_kv_cache",)),
    ):
        for name in names:
            monkeypatch.setattr(module, name, _fail)
    x, a, b = torch.randn(3, 32), torch.randn(1, 2, 4, 32), torch.randn(2, 8, 4)
    out, want = torch.zeros(3, 8), torch.zeros(3, 8)
    kernels.lora_expand(kernels.lora_shrink(x, a, [0, -1, 1]), b, [0, -1, 1], out)
    reference.lora_expand(reference.lora_shrink(x, a, [0, -1, 1]), b, [0, -1, 1], want)
    torch.testing.assert_close(out, want)
    cache = torch.zeros(2, 16, 1, 8)
    kv = torch.randn(2, 1, 8)
    kernels.write_kv_cache(kv, kv, cache, cache, torch.tensor([0, 1]))
    q = torch.randn(2, 2, 8)
    seq = (
        torch.tensor([[0]], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32),
    )
    assert kernels.paged_attention(q, cache, cache, *seq, 0.3).shape == q.shape


def test_layer_ops_on_cpu_tensors_take_the_reference_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for module, name in (
        (norm_ops, "rms_norm"),
        (norm_ops, "fused_add_rms_norm"),
        (rotary_ops, "rotary_write_kv"),
        (activation_ops, "silu_and_mul"),
    ):
        monkeypatch.setattr(module, name, _fail)
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    residual = torch.zeros(3, 8)
    torch.testing.assert_close(
        kernels.fused_add_rms_norm(x, residual, w, 1e-5), reference.rms_norm(x, w, 1e-5)
    )
    torch.testing.assert_close(residual, x)
    assert kernels.silu_and_mul(x).shape == (3, 4)
    cache, table = torch.zeros(2, 16, 1, 8), torch.randn(4, 4)
    kv, positions, slots = torch.randn(2, 1, 8), torch.tensor([0, 3]), torch.tensor([1, -1])
    q = kernels.rotary_write_kv(kv, kv, kv, table, table, positions, cache, cache, slots)
    assert q.shape == kv.shape and cache[0, 1].abs().sum() > 0 and not cache[0, 0].any()


def test_interpreter_mode_is_set_by_the_fixture_only(triton_interpret):
    assert kernels.use_triton(torch.zeros(1))
    assert triton.knobs.runtime.interpret


@pytest.mark.usefixtures("triton_interpret")
def test_the_interpreting_process_runs_every_kernel_interpreted():
    x, lora_a = torch.randn(4, 32), torch.randn(1, 2, 4, 32)
    interpreted = lora_ops.lora_shrink(x, lora_a, [0, 1, 1, -1])
    torch.testing.assert_close(interpreted, reference.lora_shrink(x, lora_a, [0, 1, 1, -1]))
    for kernel in (
        lora_ops.shrink_kernel,
        attention_ops.attention_kernel,
        norm_ops.rms_norm_kernel,
        rotary_ops.rotary_kv_kernel,
        activation_ops.silu_and_mul_kernel,
    ):
        assert kernel.interpreted


def test_a_launch_after_the_mode_changed_is_refused_and_says_why(monkeypatch):
    """This process compiles; setting the variable now cannot make it interpret."""
    assert not lora_ops.shrink_kernel.interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="jitted compiled.*chosen per process"):
        lora_ops.lora_shrink(torch.randn(4, 32), torch.randn(1, 2, 4, 32), [0, 1, 1, -1])


def test_an_interpreting_process_leaves_this_one_compiling():
    """The interpreter runs in a process of its own; Triton's helpers here stay compiled."""
    from triton.runtime.jit import JITFunction

    code = (
        "import torch\n"
        "from lorapool.kernels import lora_ops, reference\n"
        "x, a = torch.randn(4, 32), torch.randn(1, 2, 4, 32)\n"
        "torch.testing.assert_close(lora_ops.lora_shrink(x, a, [0, 1, -1, 1]),\n"
        "                           reference.lora_shrink(x, a, [0, 1, -1, 1]))\n"
        "print('interpreted', lora_ops.shrink_kernel.interpreted)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "interpreted True"
    assert isinstance(triton.language.max, JITFunction)
    assert not lora_ops.shrink_kernel.interpreted
    assert isinstance(lora_ops.shrink_kernel.jitted, JITFunction)
