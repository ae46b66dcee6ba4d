"""The references of the fused layer kernels equal the unfused torch ops the model runs
today, bit for bit, in every model dtype: the fused path changes launches, not numbers."""

import pytest
import torch
import torch.nn.functional as F

from lorapool.engine.models.layers import RMSNorm
from lorapool.engine.models.rope import RotaryEmbedding, apply_rotary
from lorapool.kernels import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_the_layer(dtype):
    norm = RMSNorm(96, 1e-5, dtype)
    norm.weight.data.copy_(_randn(96, dtype=dtype, seed=1))
    x = _randn(5, 96, dtype=dtype) * 3
    torch.testing.assert_close(reference.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=0, atol=0)
    heads = x.view(5, 2, 48)  # q_norm / k_norm: per head
    norm48 = RMSNorm(48, 1e-6, dtype)
    norm48.weight.data.copy_(_randn(48, dtype=dtype, seed=2))
    want = norm48(heads)
    torch.testing.assert_close(reference.rms_norm(heads, norm48.weight, 1e-6), want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_is_add_then_norm(dtype):
    norm = RMSNorm(80, 1e-5, dtype)
    norm.weight.data.copy_(_randn(80, dtype=dtype, seed=1))
    h, x = _randn(3, 80, dtype=dtype) * 4, _randn(3, 80, dtype=dtype, seed=2)
    want_h = h + x  # the decoder layer's residual add
    residual = h.clone()
    got = reference.fused_add_rms_norm(x, residual, norm.weight, 1e-5)
    torch.testing.assert_close(residual, want_h, rtol=0, atol=0)
    torch.testing.assert_close(got, norm(want_h), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_write_kv_is_apply_rotary_then_write(dtype):
    rope = RotaryEmbedding(64, 32, 10000.0, None, dtype)
    q, k, v = (_randn(4, heads, 64, dtype=dtype, seed=s) for s, heads in ((0, 4), (1, 2), (2, 2)))
    positions, slots = torch.tensor([0, 5, 31, 7]), torch.tensor([3, -1, 0, 9])
    cos, sin = rope(positions)
    caches = torch.zeros(2, 8, 2, 64, dtype=dtype), torch.zeros(2, 8, 2, 64, dtype=dtype)
    got_q = reference.rotary_write_kv(q, k, v, rope.cos, rope.sin, positions, *caches, slots)
    torch.testing.assert_close(got_q, apply_rotary(q, cos, sin), rtol=0, atol=0)
    want_k, want_v = torch.zeros_like(caches[0]), torch.zeros_like(caches[1])
    keep = slots >= 0
    rotated_k = apply_rotary(k, cos, sin)[keep]
    reference.write_kv_cache(rotated_k, v[keep], want_k, want_v, slots[keep])
    torch.testing.assert_close(caches[0], want_k, rtol=0, atol=0)
    torch.testing.assert_close(caches[1], want_v, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_the_mlp_activation(dtype):
    gate_up = _randn(3, 2 * 70, dtype=dtype) * 3
    gate, up = gate_up.clone().chunk(2, dim=-1)
    want = F.silu(gate, inplace=True).mul_(up)  # LlamaMLP.forward
    torch.testing.assert_close(reference.silu_and_mul(gate_up), want, rtol=0, atol=0)
