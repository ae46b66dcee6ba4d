"""Kernel launches of one decode step, per decoder layer (issue 47: at most 10 fused).

What counts as a launch: every ATen op the step dispatches that does work on a
device, plus every Triton kernel launch (``jit.Kernel[grid](...)``). Not counted:
ops that return a view or alias of an input (their schema's return is an alias
that is not written: ``view``, ``t``, ``split``, ``transpose``, ``lift_fresh`` ...),
allocations (``empty``, ``empty_strided``, ``empty_like``, ``new_empty*``), metadata
queries (``sym_size`` and kin), and the torch ops Triton's interpreter runs to move
a kernel's arguments (they do not exist on a GPU). In-place and ``out=`` ops count.

Per layer is (launches of a 4-layer model - launches of a 2-layer one) / 2 for the
same decode step of one sequence, so that per-step work (embedding, final norm,
logits, sampling, the step's host-to-device copies) cancels.

A composite op the mode sees whole counts once (``aten.linear``: one GEMM;
``aten.rms_norm``, though in half precision today's RMSNorm is four ops), so the
unfused count is a lower bound of what a GPU launches (issue 47 measured 32 a
layer in bf16 on an H200).

Measured on the tiny llama (fp32, interpreter, one decode sequence; the attention
kernel does not split the short context: on a GPU a long one adds the combining
kernel, +1 a layer):

    unfused (fused_layer_kernels=False): 26 a layer: 4 linear, RoPE 14 (8 mul,
        2 sub, 2 add, 2 cat), 2 rms_norm, 2 residual adds, silu_ + mul_,
        write_kv_cache, attention
    fused:                               9 a layer: 4 linear, 2 rms_norm (residual
        add fused), rotary_write_kv, attention, silu_and_mul
    with an adapter on all 7 projections (rank 8), 3 LoRA launches per packed
        projection today (zero_, shrink, expand; kernels/lora_ops.py):
        unfused 38, fused 21 a layer (the bound applies to the launches outside
        ``kernels.lora_linear``)
    with ``lora_live_work`` (the shrink's split-K partials added inside the expand):
        2 LoRA launches per packed projection, 8 a layer (qkv, o, gate_up, down)
"""

import collections

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.interpret
MAX_FUSED_LAUNCHES_PER_LAYER = 10
NO_LAUNCH = {
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_contiguous",
}


def _launches_work(func) -> bool:
    if func.overloadpacket.__name__ in NO_LAUNCH:
        return False
    aliases = [r.alias_info for r in func._schema.returns]
    return not any(a is not None and not a.is_write for a in aliases)


class LaunchCounter(TorchDispatchMode):
    """Counts launches by name: ATen ops here, Triton kernels through ``count_triton``."""

    def __init__(self):
        super().__init__()
        self.launches = collections.Counter()
        self.in_triton = False
        self.scope = ""  # "lora." while a LoRA op runs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_triton and _launches_work(func):
            self.launches[f"{self.scope}aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))

    def scoped(self, scope: str, fn):
        def call(*args, **kwargs):
            self.scope = scope
            try:
                return fn(*args, **kwargs)
            finally:
                self.scope = ""

        return call

    def count_triton(self, kernel, launcher):
        def launch(*args, **kwargs):
            self.launches[f"{self.scope}triton.{kernel.fn.__name__}"] += 1
            self.in_triton = True  # the interpreter's own argument copies are no launches
            try:
                return launcher(*args, **kwargs)
            finally:
                self.in_triton = False

        return launch


def _decode_step_launches(path, monkeypatch, lora=None, **engine_kw) -> collections.Counter:
    from lorapool import EngineArgs, LLMEngine, SamplingParams, kernels
    from lorapool.kernels import jit

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(path), **engine_kw))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params, lora_request=lora)
    engine.step()  # the prefill
    counter = LaunchCounter()
    launcher_of = jit.Kernel.__getitem__
    with monkeypatch.context() as patch:
        patch.setattr(
            jit.Kernel, "__getitem__", lambda k, grid: counter.count_triton(k, launcher_of(k, grid))
        )
        patch.setattr(kernels, "lora_linear", counter.scoped("lora.", kernels.lora_linear))
        with counter:
            engine.step()  # one decode step
    return counter.launches


def _per_layer(tiny_model_path, monkeypatch, tmp_path, with_lora=False, **engine_kw):
    """(launches per layer, the 4-layer minus 2-layer difference by name)."""
    from adapters import ALL_TARGETS, build_adapter

    from lorapool import LoRARequest

    counts = []
    for num_layers in (2, 4):
        path = tiny_model_path("llama", num_hidden_layers=num_layers)
        lora = None
        if with_lora:
            adapter = build_adapter(path, tmp_path / f"a{num_layers}", targets=ALL_TARGETS)
            lora = LoRARequest("a", 1, str(adapter))
            engine_kw = dict(engine_kw, enable_lora=True, max_loras=1, max_lora_rank=8)
        counts.append(_decode_step_launches(path, monkeypatch, lora, **engine_kw))
    diff = counts[1].copy()
    diff.subtract(counts[0])
    return _halve(sum(diff.values())), +diff


def _halve(n: int) -> int:
    assert n % 2 == 0, n
    return n // 2


@pytest.mark.parametrize("with_lora", [False, True])
def test_fused_decode_step_launches_at_most_10_per_layer(
    tiny_model_path, monkeypatch, tmp_path, triton_interpret, with_lora
):
    per_layer, diff = _per_layer(
        tiny_model_path, monkeypatch, tmp_path, with_lora, fused_layer_kernels=True
    )
    print(f"fused, lora={with_lora}: {per_layer} launches a layer; 2 layers: {dict(diff)}")
    lora = _halve(sum(n for name, n in diff.items() if name.startswith("lora.")))
    assert per_layer - lora <= MAX_FUSED_LAUNCHES_PER_LAYER, diff  # the LoRA kernels aside
    assert (lora > 0) == with_lora


def test_unfused_decode_step_launches_more_than_10_per_layer(
    tiny_model_path, monkeypatch, tmp_path, triton_interpret
):
    """The counter sees what the fused path saves: today's path is over the bound."""
    per_layer, diff = _per_layer(tiny_model_path, monkeypatch, tmp_path)
    print(f"unfused: {per_layer} launches a layer; 2 layers: {dict(diff)}")
    assert per_layer > MAX_FUSED_LAUNCHES_PER_LAYER, diff


PACKED_PROJECTIONS = 4  # qkv_proj, o_proj, gate_up_proj, down_proj


@pytest.mark.parametrize("live_work", [False, True])
def test_lora_launches_per_layer(
    tiny_model_path, monkeypatch, tmp_path, triton_interpret, live_work
):
    """``lora_live_work``: a LoRA projection is 2 launches (shrink, expand), no zeroing or sum."""
    _, diff = _per_layer(
        tiny_model_path,
        monkeypatch,
        tmp_path,
        with_lora=True,
        fused_layer_kernels=True,
        lora_live_work=live_work,
    )
    lora = _halve(sum(n for name, n in diff.items() if name.startswith("lora.")))
    print(f"lora_live_work={live_work}: {lora} LoRA launches a layer: {dict(diff)}")
    if live_work:
        assert lora == 2 * PACKED_PROJECTIONS, diff
    else:
        assert lora > 2 * PACKED_PROJECTIONS, diff
