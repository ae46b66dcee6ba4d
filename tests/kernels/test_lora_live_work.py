"""The live-work LoRA path (``lora_ops.lora_linear``) against the fp32 reference.

Two launches a projection: the shrink writes split-K partials into an ``empty``
buffer, the expand adds them in split order. Checked, interpreted, over odd
shapes, every dtype and adapter popularity, split-K 1 to 8, a CUDA graph's
padded tiles, base tokens, unwritten partial rows (NaN-filled here) and bit-for-bit
repeats; and the launches a projection makes with the engine's flag on and off.
"""

from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from lorapool import kernels
from lorapool.engine.cuda_graphs import LORA_BLOCK_M, live_tiles, max_tiles, padded_plan
from lorapool.kernels import LoRAMapping, jit, lora_ops, reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NUM_SLOTS = 8
RANKS = (1, 5, 16, 8, 13, 16, 2, 9)  # per slot, zero-padded to the call's rank 16


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    hidden: int
    num_tokens: int
    popularity: str
    widths: tuple[int, ...]
    split_k: int | None  # None: the heuristics
    base_share: float = 0.0

    def __str__(self):
        dtype = str(self.dtype).removeprefix("torch.")
        widths = "_".join(map(str, self.widths))
        shape = f"h{self.hidden}-t{self.num_tokens}-w{widths}"
        return f"{dtype}-{shape}-{self.popularity}-k{self.split_k}"


CASES = [
    Case(F32, 100, 7, "distinct", (24, 8, 8), 1, base_share=0.3),
    Case(BF16, 577, 33, "uniform", (40, 24), 2, base_share=0.2),
    Case(F16, 250, 19, "zipf", (72,), 4, base_share=0.4),
    Case(F32, 1000, 1, "identical", (48, 16, 16), 8),
    Case(BF16, 96, 40, "skewed", (33, 17, 17), 4, base_share=0.1),
    Case(F16, 130, 5, "distinct", (64, 16, 16), 8),
    Case(F32, 300, 24, "zipf", (100,), None, base_share=0.5),
    Case(BF16, 1000, 2, "identical", (56, 8, 8), None),
]


def _slots(case: Case, gen: torch.Generator) -> list[int]:
    n = case.num_tokens
    if case.popularity == "distinct":
        slots = torch.randperm(NUM_SLOTS, generator=gen)[:n].repeat(n)[:n]
    elif case.popularity == "identical":
        slots = torch.full((n,), NUM_SLOTS - 1)
    else:
        weights = {
            "uniform": torch.ones(NUM_SLOTS),
            "zipf": 1.0 / torch.arange(1, NUM_SLOTS + 1).float() ** 1.2,
            "skewed": torch.tensor([20.0] + [1.0] * (NUM_SLOTS - 1)),
        }[case.popularity]
        slots = torch.multinomial(weights, n, replacement=True, generator=gen)
    base = torch.rand(n, generator=gen) < case.base_share
    return torch.where(base, -1, slots).tolist()


def _batch(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    slots = _slots(case, gen)
    live = torch.arange(16)[None, :] < torch.tensor(RANKS)[:, None]  # [L, R]
    a = torch.randn(len(case.widths), NUM_SLOTS, 16, case.hidden, generator=gen)
    a = a * live[None, :, :, None] / case.hidden**0.5
    b = torch.randn(NUM_SLOTS, sum(case.widths), 16, generator=gen) * 0.1 * live[:, None, :]
    x = torch.randn(len(slots), case.hidden, generator=gen)
    out = torch.randn(len(slots), sum(case.widths), generator=gen)
    return tuple(t.to(case.dtype) for t in (x, a, b, out)) + (slots,)


def _want(x, a, b, out, slots, widths, num_tokens=None):
    """The reference over the first ``num_tokens`` tokens (the real rows of a padded batch)."""
    n = len(slots) if num_tokens is None else num_tokens
    want = out.clone()
    y = reference.lora_shrink(x[:n], a, slots[:n])
    reference.lora_expand(y, b, slots[:n], want[:n], widths)
    return want


def _config(split_k):
    return None if split_k is None else {"SPLIT_K": split_k, "BLOCK_K": 32}


@pytest.fixture
def nan_partials(monkeypatch):
    """Every ``new_empty`` tensor starts as NaN: a partial row the expand reads but no
    shrink wrote would show."""
    new_empty = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):
        t = new_empty(self, *args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)


@pytest.mark.usefixtures("triton_interpret", "nan_partials")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_live_path_matches_reference(case, tolerances):
    x, a, b, out, slots = _batch(case)
    got = out.clone()
    mapping = LoRAMapping.from_slots(slots)
    lora_ops.lora_linear(x, a, b, mapping, got, case.widths, _config(case.split_k))
    want = _want(x, a, b, out, slots, case.widths)
    torch.testing.assert_close(got.float(), want.float(), **tolerances[case.dtype])
    base = torch.tensor(slots) == -1
    assert torch.equal(got[base], out[base]), "rows of slot -1 must be untouched"


@pytest.mark.usefixtures("triton_interpret", "nan_partials")
@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_graph_padded_tiles(dtype, split_k, tolerances):
    """A decode step in a graph of 24 rows: padding tokens (slot -1) and empty tiles."""
    case = Case(dtype, 200, 13, "zipf", (40, 12, 12), split_k, base_share=0.2)
    x, a, b, out, slots = _batch(case)
    size, max_loras = 24, NUM_SLOTS
    num_tiles = max_tiles(size, max_loras)
    order, tiles = padded_plan(slots, size, num_tiles)
    mapping = LoRAMapping(
        num_tokens=size,
        max_slot=max_loras - 1,
        segments=(),
        order=torch.tensor(order),
        tiles=torch.tensor(tiles).view(3, -1),
        block_m=LORA_BLOCK_M,
        live_tiles=live_tiles(size, max_loras),
    )
    gen = torch.Generator().manual_seed(1)
    x_pad = torch.cat([x, torch.randn(size - len(slots), 200, generator=gen).to(dtype)])
    out_pad = torch.cat([out, torch.randn(size - len(slots), 64, generator=gen).to(dtype)])
    got = out_pad.clone()
    lora_ops.lora_linear(x_pad, a, b, mapping, got, case.widths, _config(split_k))
    want = _want(x_pad, a, b, out_pad, slots, case.widths, num_tokens=len(slots))
    torch.testing.assert_close(got.float(), want.float(), **tolerances[dtype])
    untouched = torch.tensor(slots + [-1] * (size - len(slots))) == -1
    assert torch.equal(got[untouched], out_pad[untouched])


@pytest.mark.usefixtures("triton_interpret")
@pytest.mark.parametrize("split_k", [4, 8])
def test_repeats_bit_for_bit(split_k):
    case = Case(BF16, 577, 9, "uniform", (40, 24), split_k)
    x, a, b, out, slots = _batch(case)
    mapping = LoRAMapping.from_slots(slots)
    runs = []
    for _ in range(2):
        got = out.clone()
        lora_ops.lora_linear(x, a, b, mapping, got, case.widths, _config(split_k))
        runs.append(got)
    assert torch.equal(runs[0], runs[1])


def test_live_tiles_of_a_graph_bucket():
    assert [live_tiles(s, 8) for s in (1, 4, 8, 16, 64, 128, 256)] == [1, 4, 8, 8, 8, 8, 16]
    assert all(live_tiles(s, m) <= max_tiles(s, m) for s in range(1, 300) for m in (1, 4, 8, 32))
    mapping = LoRAMapping.from_slots([0, 1, 1])
    assert mapping.work_tiles == mapping.num_tiles == 2


class _WorkOps(TorchDispatchMode):
    """The ATen ops a call runs that do work on the device: no views, no allocations."""

    ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in self.ALLOCATIONS:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _launches(monkeypatch, live_work: bool) -> list[str]:
    """Kernel launches and ATen ops of one ``kernels.lora_linear`` at a decode shape
    whose reduction is split (one adapter token among base tokens)."""
    kernels_run = []
    getitem = jit.Kernel.__getitem__

    def counted(self, grid):
        launch = getitem(self, grid)

        def run(*args, **kwargs):
            kernels_run.append(self.fn.__name__)
            with _disable_current_modes():  # the interpreter's own copies are not the call's
                return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(jit.Kernel, "__getitem__", counted)
    case = Case(F32, 1024, 3, "identical", (64,), None)
    x, a, b, out, _ = _batch(case)
    mapping = LoRAMapping.from_slots([-1, 2, -1])
    assert lora_ops.split_k_factor(1, 1024 // 128, x.device) > 1  # the split is taken
    with _WorkOps() as ops:
        kernels.lora_linear(x, a, b, mapping, out, case.widths, live_work)
    return kernels_run + ops.names


@pytest.mark.usefixtures("triton_interpret")
def test_two_launches_a_projection_with_live_work(monkeypatch):
    assert _launches(monkeypatch, live_work=True) == ["_shrink_kernel", "_expand_kernel"]


@pytest.mark.usefixtures("triton_interpret")
def test_five_launches_a_projection_without(monkeypatch):
    """Today's sequence, kept while ``EngineArgs.lora_live_work`` is off."""
    launches = _launches(monkeypatch, live_work=False)
    assert sorted(launches) == sorted(
        ["zero_", "new_zeros", "_shrink_kernel", "sum", "_expand_kernel"]
    ), launches


@pytest.mark.parametrize(
    "config, message",
    [
        ({"BLOCK_Q": 16}, "unknown fields"),
        ({"SPLIT_K": 0}, "positive int"),
        ({"BLOCK_K": 48}, "power of two"),
        ({"BLOCK_N": 64}, "unknown fields"),  # the shrink has no columns
    ],
)
def test_rejects_bad_configs(config, message):
    x, a, _, _, slots = _batch(CASES[0])
    with pytest.raises(ValueError, match=message):
        lora_ops.lora_shrink(x, a, slots, config=config)


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device; the interpreter tests cover the kernels",
)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4]], ids=str)
def test_cuda_live_path_matches_reference_and_repeats_bit_for_bit(case, tolerances):
    x, a, b, out, slots = _batch(case)
    want = _want(x, a, b, out, slots, case.widths)
    mapping = LoRAMapping.from_slots(slots, "cuda")
    x, a, b = x.cuda(), a.cuda(), b.cuda()
    runs = []
    for _ in range(20):
        got = out.cuda()
        lora_ops.lora_linear(x, a, b, mapping, got, case.widths)  # heuristic split-K
        runs.append(got)
    torch.testing.assert_close(runs[0].cpu().float(), want.float(), **tolerances[case.dtype])
    assert all(torch.equal(run, runs[0]) for run in runs)


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_replays_the_live_path_over_static_tiles(tolerances):
    """Captured once over ``StaticLoRA``'s buffers, replayed for two different steps."""
    from lorapool.engine.cuda_graphs import StaticLoRA

    case = Case(BF16, 577, 16, "zipf", (40, 12, 12), None)
    x, a, b, out, _ = _batch(case)
    size = x.shape[0]
    static = StaticLoRA(size, NUM_SLOTS, torch.device("cuda"))
    x_dev, a_dev, b_dev, out_dev = x.cuda(), a.cuda(), b.cuda(), out.cuda()

    def step():
        lora_ops.lora_linear(x_dev, a_dev, b_dev, static.mapping, out_dev, case.widths)

    static.fill([0] * size)
    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for slots in ([1, -1, 3, 3, 0, 7] + [-1] * 10, [5] * 9 + [2] * 7):
        static.fill(slots)
        out_dev.copy_(out)
        graph.replay()
        want = _want(x, a, b, out, slots, case.widths)
        torch.testing.assert_close(out_dev.cpu().float(), want.float(), **tolerances[BF16])
