"""The fused layer kernels (RMSNorm, residual add + RMSNorm, RoPE + KV write, SiLU-mul)
against ``reference``, interpreted, over odd shapes and every model dtype."""

import pytest
import torch

from lorapool.kernels import reference

pytestmark = pytest.mark.interpret
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _exact(dtype, tolerances) -> dict:
    """Exact, but for bf16: Triton's interpreter truncates fp32 -> bf16 casts (GPUs round
    them to nearest, as torch does), so a rounded bf16 sum may be one ulp off here."""
    return tolerances[dtype] if dtype == torch.bfloat16 else {"rtol": 0, "atol": 0}


def _rounded(dtype, tolerances, want) -> dict:
    """Tolerances of a result rounded several times on the way (norm, products, sum): in
    bf16 the interpreter's truncations may each leave an ulp of the largest operand,
    more than the absolute tolerance where a difference cancels, so atol scales with it."""
    if dtype != torch.bfloat16:
        return tolerances[dtype]
    scale = max(1.0, want.abs().max().item())
    return {"rtol": tolerances[dtype]["rtol"], "atol": tolerances[dtype]["atol"] * scale}


def _randn(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7])
@pytest.mark.parametrize("hidden", [64, 200])
def test_rms_norm(triton_interpret, tolerances, dtype, num_tokens, hidden):
    from lorapool.kernels import norm_ops

    x = _randn(num_tokens, hidden, dtype=dtype) * 3
    weight = _randn(hidden, dtype=dtype, seed=1)
    got = norm_ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, reference.rms_norm(x, weight, 1e-5), **tolerances[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_heads(triton_interpret, tolerances, dtype):
    from lorapool.kernels import norm_ops

    packed = _randn(5, 3 * 80 + 17, dtype=dtype)
    heads = packed[:, 17:].view(5, 3, 80)  # [T, H, d] with a token stride of 257
    weight = _randn(80, dtype=dtype, seed=1)
    got = norm_ops.rms_norm(heads, weight, 1e-6)
    torch.testing.assert_close(got, reference.rms_norm(heads, weight, 1e-6), **tolerances[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("hidden", [80, 333])
def test_fused_add_rms_norm(triton_interpret, tolerances, dtype, num_tokens, hidden):
    from lorapool.kernels import norm_ops

    x = _randn(num_tokens, hidden, dtype=dtype)
    residual = _randn(num_tokens, hidden, dtype=dtype, seed=2) * 4
    weight = _randn(hidden, dtype=dtype, seed=1)
    want_residual = residual.clone()
    want = reference.fused_add_rms_norm(x, want_residual, weight, 1e-5)
    got = norm_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, want_residual, **_exact(dtype, tolerances))
    torch.testing.assert_close(got, want, **tolerances[dtype])


def _rotary_case(dtype, num_tokens, head_dim, num_q_heads=5, num_kv_heads=3):
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(num_tokens, width, dtype=dtype)  # q, k, v: strided views, as in the model
    q, k, v = qkv.split([num_q_heads * head_dim] + [num_kv_heads * head_dim] * 2, dim=-1)
    q = q.view(num_tokens, num_q_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    g = torch.Generator().manual_seed(num_tokens * head_dim)
    angles = torch.arange(40).float()[:, None] * torch.rand(head_dim // 2, generator=g)[None, :]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, 40, (num_tokens,), generator=g)
    slots = torch.randperm(4 * 8, generator=g)[:num_tokens]
    slots[::3] = -1  # padding rows write nothing
    cache_shape = (4, 8, num_kv_heads, head_dim)
    caches = _randn(*cache_shape, dtype=dtype, seed=3), _randn(*cache_shape, dtype=dtype, seed=4)
    return (q, k, v, cos, sin, positions), caches, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_write_kv(triton_interpret, tolerances, dtype, num_tokens, head_dim, qk_norm):
    from lorapool.kernels import rotary_ops

    args, (key_cache, value_cache), slots = _rotary_case(dtype, num_tokens, head_dim)
    norm = None
    if qk_norm:
        norm = (_randn(head_dim, dtype=dtype, seed=5), _randn(head_dim, dtype=dtype, seed=6), 1e-6)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    want_q = reference.rotary_write_kv(*args, want_k, want_v, slots, norm)
    got_q = rotary_ops.rotary_write_kv(*args, key_cache, value_cache, slots, norm)
    torch.testing.assert_close(got_q, want_q, **_rounded(dtype, tolerances, want_q))
    torch.testing.assert_close(key_cache, want_k, **_rounded(dtype, tolerances, want_k))
    torch.testing.assert_close(value_cache, want_v, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 6])
@pytest.mark.parametrize("inter", [37, 1500])
def test_silu_and_mul(triton_interpret, tolerances, dtype, num_tokens, inter):
    from lorapool.kernels import activation_ops

    gate_up = _randn(num_tokens, 2 * inter, dtype=dtype) * 3
    got = activation_ops.silu_and_mul(gate_up)
    torch.testing.assert_close(got, reference.silu_and_mul(gate_up), **tolerances[dtype])
