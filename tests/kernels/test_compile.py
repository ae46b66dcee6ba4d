"""The kernels compile for a GPU (sm_90 cubin, ptxas included) on a machine without one.

The interpreter runs kernels as Python and accepts code that the compiler
rejects; this catches that without a GPU. Each wrapper runs on CPU tensors up
to its launch, which is captured and compiled exactly as it would be issued.
"""

import pytest
import torch

from lorapool.kernels import (
    LoRAMapping,
    activation_ops,
    attention_ops,
    kv_cache_ops,
    lora_ops,
    norm_ops,
    rotary_ops,
)
from lorapool.kernels.jit import Kernel

triton = pytest.importorskip("triton", reason="Triton is not installed")
compiler = pytest.importorskip("triton.compiler")
GPUTarget = pytest.importorskip("triton.backends.compiler").GPUTarget

F32, BF16 = torch.float32, torch.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")


@pytest.fixture
def launches(monkeypatch):
    """Kernel launches made by wrappers, captured instead of run."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    captured = []

    def capture(self, grid):
        return lambda *args, **kwargs: captured.append((self, args, kwargs))

    monkeypatch.setattr(Kernel, "__getitem__", capture)
    return captured


def _compile_all(launches) -> None:
    from triton.runtime.jit import mangle_type

    assert launches
    for kernel, args, constexprs in launches:
        fn = kernel.jitted
        signature = {name: mangle_type(arg) for name, arg in zip(fn.arg_names, args)}
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        source = compiler.ASTSource(fn, signature, constexprs=constexprs)
        compiler.compile(source, target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize(
    "dtype, slots",
    [(BF16, [0, 1, -1, 1]), (BF16, [2] * 100 + [0]), (F32, [0, 1])],
    ids=["decode", "prefill", "fp32"],
)
def test_lora_kernels_compile(launches, dtype, slots):
    mapping = LoRAMapping.from_slots(slots)
    x = torch.zeros(len(slots), 576, dtype=dtype)
    y = lora_ops.lora_shrink(x, torch.zeros(3, 4, 16, 576, dtype=dtype), mapping)
    out = torch.zeros(len(slots), 960, dtype=dtype)
    lora_ops.lora_expand(y, torch.zeros(4, 960, 16, dtype=dtype), mapping, out, (576, 192, 192))
    _compile_all(launches)


@pytest.mark.parametrize("split_k", [1, 4])
def test_live_work_lora_kernels_compile(launches, split_k):
    """The two-launch path: partials [SPLIT_K, S, T, R] added inside the expand."""
    mapping = LoRAMapping.from_slots([0, 1, -1, 1])
    x, out = torch.zeros(4, 576, dtype=BF16), torch.zeros(4, 960, dtype=BF16)
    a, b = torch.zeros(3, 4, 16, 576, dtype=BF16), torch.zeros(4, 960, 16, dtype=BF16)
    lora_ops.lora_linear(x, a, b, mapping, out, (576, 192, 192), {"SPLIT_K": split_k})
    assert [constexprs["SPLIT_K"] for _, _, constexprs in launches] == [split_k, split_k]
    _compile_all(launches)


@pytest.mark.parametrize(
    "q_lens, ctx_lens", [([1, 1], [1000, 5]), ([30, 1], [70, 9])], ids=["decode-split", "prefill"]
)
def test_attention_kernels_compile(launches, q_lens, ctx_lens):
    cache = torch.zeros(80, 16, 3, 64, dtype=BF16)
    q = torch.zeros(sum(q_lens), 9, 64, dtype=BF16)
    tables = torch.zeros(len(q_lens), 64, dtype=torch.int32)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    qsl = torch.tensor([0, *q_lens]).cumsum(0).int()
    attention_ops.paged_attention(q, cache, cache, tables, seq_lens, qsl, 0.125)
    kv_cache_ops.write_kv_cache(q[:, :3], q[:, 3:6], cache, cache, torch.arange(len(q)))
    _compile_all(launches)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_layer_kernels_compile(launches, dtype, qk_norm):
    x = torch.zeros(3, 576, dtype=dtype)
    weight = torch.zeros(576, dtype=dtype)
    norm_ops.rms_norm(x, weight, 1e-5)
    norm_ops.fused_add_rms_norm(x, x.clone(), weight, 1e-5)
    activation_ops.silu_and_mul(torch.zeros(3, 2 * 1536, dtype=dtype))
    qkv = torch.zeros(3, 15 * 80, dtype=dtype)
    q, k, v = qkv.split([9 * 80, 3 * 80, 3 * 80], dim=-1)
    cache = torch.zeros(8, 16, 3, 80, dtype=dtype)
    table = torch.zeros(64, 40, dtype=dtype)
    norm = (torch.zeros(80, dtype=dtype), torch.zeros(80, dtype=dtype), 1e-6) if qk_norm else None
    rotary_ops.rotary_write_kv(
        q.view(3, 9, 80),
        k.view(3, 3, 80),
        v.view(3, 3, 80),
        table,
        table,
        torch.arange(3),
        cache,
        cache,
        torch.tensor([5, -1, 7]),
        norm,
    )
    _compile_all(launches)
