"""kernels.lora_linear (shrink and expand in one call) against the fp32 reference.

On the CPU it runs the planned path of ``kernels/lora_cpu.py`` (prefill runs
as matmuls, decode tokens as a slot grid); under the interpreter, the Triton
kernels. Both must equal ``reference.lora_shrink`` then ``reference.lora_expand``
for every layout the engine stores its weights in.
"""

import pytest
import torch

from lorapool import kernels
from lorapool.kernels import LoRAMapping, lora_cpu, reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NUM_SLOTS, MAX_RANK = 8, 16


def _slots(pattern: str, gen: torch.Generator) -> list[int]:
    """Token slots of a batch: decode tokens, prefill runs and base tokens mixed."""
    if pattern == "decode":  # a few tokens per adapter, interleaved, some base
        return torch.randint(-1, NUM_SLOTS, (29,), generator=gen).tolist()
    if pattern == "mixed":  # prefill chunks of two adapters between decode tokens
        return [3, -1, 5, 3] + [2] * 40 + [0, 7, -1, 0] + [6] * 17 + [-1] * 20 + [1, 1]
    if pattern == "uniform":  # every slot the same number of tokens: no padding
        return [i % NUM_SLOTS for i in range(4 * NUM_SLOTS)]
    if pattern == "sparse":  # two slots far apart: gathered, not a range
        return [0, 7, 0, -1, 7]
    if pattern == "gap":  # slots 1, 2 and 4: a range with an idle row (3)
        return [1, 4, 2, 4, 1, 1]
    raise ValueError(pattern)


def _weights(widths, hidden: int, dtype, gen, rank_major: bool):
    """A [S, L, R, H] and B [L, N, R] views (ranks mixed, zero-padded to MAX_RANK),
    stored as the engine does (slot-major A, rank-major B) or plainly."""
    ranks = torch.tensor([(4, 16, 1, 8, 13, 16, 2, 9)[s] for s in range(NUM_SLOTS)])
    live = torch.arange(MAX_RANK)[None, :] < ranks[:, None]  # [L, R]
    a = torch.randn(NUM_SLOTS, len(widths), MAX_RANK, hidden, generator=gen) / hidden**0.5
    a = a * live[:, None, :, None]
    b = torch.randn(NUM_SLOTS, MAX_RANK, sum(widths), generator=gen) * 0.1 * live[:, :, None]
    a, b = a.to(dtype), b.to(dtype)
    if rank_major:
        return a.transpose(0, 1), b.transpose(1, 2)
    return a.transpose(0, 1).contiguous(), b.transpose(1, 2).contiguous()


def _expected(x, a, b, slots, out, widths):
    want = out.clone()
    reference.lora_expand(reference.lora_shrink(x, a, slots), b, slots, want, widths)
    return want


def _case(pattern, widths, dtype, rank_major=True, hidden=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = _slots(pattern, gen)
    x = torch.randn(len(slots), hidden, generator=gen).to(dtype)
    out = torch.randn(len(slots), sum(widths), generator=gen).to(dtype)
    a, b = _weights(widths, hidden, dtype, gen, rank_major)
    return x, a, b, slots, out


@pytest.mark.parametrize("rank_major", [True, False], ids=["engine-layout", "plain-layout"])
@pytest.mark.parametrize("widths", [(48,), (40, 24), (64, 16, 16)], ids=str)
@pytest.mark.parametrize("pattern", ["decode", "mixed", "uniform", "sparse", "gap"])
def test_cpu_path_matches_reference(pattern, widths, rank_major):
    x, a, b, slots, out = _case(pattern, widths, F32, rank_major)
    got = out.clone()
    kernels.lora_linear(x, a, b, LoRAMapping.from_slots(slots), got, widths)
    torch.testing.assert_close(got, _expected(x, a, b, slots, out, widths), rtol=1e-5, atol=1e-5)
    base = torch.tensor(slots) == -1
    assert torch.equal(got[base], out[base]), "rows of slot -1 must be untouched"


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_half_precision_matches_reference(dtype, tolerances):
    widths = (40, 24)
    x, a, b, slots, out = _case("mixed", widths, dtype)
    got = out.clone()
    kernels.lora_linear(x, a, b, LoRAMapping.from_slots(slots), got, widths)
    assert got.dtype == dtype
    want = _expected(x, a, b, slots, out, widths)
    torch.testing.assert_close(got.float(), want.float(), **tolerances[dtype])


def test_step_rank_below_the_buffers_rank():
    """The engine passes the first ``rank`` columns of its buffers (a strided view)."""
    widths = (40, 24)
    x, a, b, slots, out = _case("mixed", widths, F32)
    a, b = a[:, :, :9], b[:, :, :9]  # slots of rank above 9 lose their tail: still a valid call
    got = out.clone()
    kernels.lora_linear(x, a, b, LoRAMapping.from_slots(slots), got, widths)
    torch.testing.assert_close(got, _expected(x, a, b, slots, out, widths), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern", ["gap", "decode", "mixed"])
def test_a_broken_slot_harms_only_its_own_tokens(pattern):
    """NaN weights in slot 3 (idle inside the grid's range for "gap", in use for
    the others) reach no other token: grid padding and idle rows are dropped."""
    widths = (64, 16, 16)
    x, a, b, slots, out = _case(pattern, widths, F32)
    a[:, 3], b[3] = float("nan"), float("nan")
    got = out.clone()
    kernels.lora_linear(x, a, b, LoRAMapping.from_slots(slots), got, widths)
    own = torch.tensor(slots) == 3
    assert not got[~own].isnan().any()
    assert got[own].isnan().all()
    healthy = ~own
    want = _expected(x, a, b, slots, out, widths)
    torch.testing.assert_close(got[healthy], want[healthy], rtol=1e-5, atol=1e-5)


def test_plan_splits_long_runs_from_the_grid():
    slots = [2] * (lora_cpu.RUN_MIN + 1) + [0, 0, -1, 3] + [1] * lora_cpu.RUN_MIN
    plan = LoRAMapping.from_slots(slots).cpu_plan
    assert plan.runs == ((2, 0, lora_cpu.RUN_MIN + 1),)
    grid = plan.grid  # slots 0, 1, 3: the range 0..3, idle row 2 included
    assert (grid.first_slot, grid.num_rows, grid.width, grid.slots) == (
        0,
        4,
        lora_cpu.RUN_MIN,
        None,
    )
    assert grid.targets.tolist() == [17, 18, *range(21, 21 + lora_cpu.RUN_MIN), 20]
    assert LoRAMapping.from_slots([0, 9, 9]).cpu_plan.grid.slots.tolist() == [0, 9]
    assert LoRAMapping.from_slots([0, 1, 1, 0]).cpu_plan.grid.cells is None
    assert LoRAMapping.from_slots([-1, -1]).cpu_plan == lora_cpu.CpuPlan((), None)


@pytest.mark.usefixtures("triton_interpret")
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("rank_major", [True, False], ids=["engine-layout", "plain-layout"])
def test_triton_kernels_take_either_layout(rank_major, dtype, tolerances):
    widths = (64, 16, 16)
    x, a, b, slots, out = _case("mixed", widths, dtype, rank_major)
    got = out.clone()
    kernels.lora_linear(x, a, b, LoRAMapping.from_slots(slots), got, widths)
    want = _expected(x, a, b, slots, out, widths)
    torch.testing.assert_close(got.float(), want.float(), **tolerances[dtype])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda x, a, b, m, o, w: (x[:, :50], a, b, m, o, w), "lora_a wants"),
        (lambda x, a, b, m, o, w: (x, a, b[:, :, :3], m, o, w), "lora_b has shape"),
        (lambda x, a, b, m, o, w: (x, a, b, m, o[:, :10], w), "out has shape"),
        (lambda x, a, b, m, o, w: (x, a, b, LoRAMapping.from_slots([0]), o, w), "1 tokens"),
        (lambda x, a, b, m, o, w: (x, a, b, LoRAMapping.from_slots([9] * 5), o, w), "slot 9"),
        (lambda x, a, b, m, o, w: (x, a, b, m, o, (40, 20)), "slice_widths"),
    ],
)
def test_rejects_bad_arguments(mutate, message):
    x, a, b, slots, out = _case("sparse", (40, 24), F32)
    args = mutate(x, a, b, LoRAMapping.from_slots(slots), out, (40, 24))
    with pytest.raises(ValueError, match=message):
        kernels.lora_linear(*args)
