"""LoRA shrink/expand: the Triton kernels against the fp32 reference.

Each case is one mixed-adapter batch; together the cases cover every dtype,
hidden size, token count, adapter popularity, share of base-model tokens and
slice count of the acceptance list (not their full cross product, which the
interpreter could not run in time). Every batch mixes ranks 1 to 64.
"""

from dataclasses import dataclass

import pytest
import torch

from lorapool import kernels
from lorapool.kernels import LoRAMapping, lora_ops, reference

RANKS = (1, 3, 8, 16, 33, 64)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    hidden: int
    num_tokens: int  # decode-like tokens, spread over adapters by popularity
    popularity: str
    widths: tuple[int, ...]
    base_share: float = 0.0  # share of tokens with slot -1
    prefill: int = 0  # plus one segment of this many tokens of one adapter

    def __str__(self):
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{dtype}-h{self.hidden}-t{self.num_tokens}+{self.prefill}-{self.popularity}"
            f"-w{'_'.join(map(str, self.widths))}-base{self.base_share}"
        )


CASES = [
    Case(F32, 576, 1, "identical", (576,)),
    Case(F16, 1000, 7, "distinct", (96, 200)),
    Case(BF16, 1536, 64, "uniform", (576, 192, 192)),
    Case(F32, 1000, 33, "zipf", (64, 40, 40), base_share=0.25),
    Case(F16, 576, 64, "skewed", (200,), base_share=0.5),
    Case(BF16, 576, 12, "uniform", (128, 64), prefill=300),
    Case(F32, 1536, 16, "uniform", (64,), base_share=1.0),
    Case(F16, 1536, 2, "zipf", (192, 64, 64)),
    Case(BF16, 1000, 20, "skewed", (80, 48, 48), base_share=0.1, prefill=300),
    Case(F32, 576, 0, "identical", (64, 32), prefill=300),
]


def _slots(case: Case, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    n = case.num_tokens
    if case.popularity == "distinct":
        slots = torch.randperm(num_slots, generator=gen)[:n]
    elif case.popularity == "identical":
        slots = torch.full((n,), num_slots - 1)
    else:
        weights = {
            "uniform": torch.ones(num_slots),
            "zipf": 1.0 / torch.arange(1, num_slots + 1).float() ** 1.2,
            "skewed": torch.tensor([20.0] + [1.0] * (num_slots - 1)),
        }[case.popularity]
        slots = (
            torch.multinomial(weights, n, replacement=True, generator=gen)
            if n
            else torch.zeros(0, dtype=torch.int64)
        )
    base = torch.rand(n, generator=gen) < case.base_share
    slots = torch.where(base, -1, slots)
    prefill = torch.full((case.prefill,), int(torch.randint(num_slots, (1,), generator=gen)))
    return torch.cat([slots[: n // 2], prefill, slots[n // 2 :]])  # prefill mid-batch


def _rank_mask(num_slots: int, max_rank: int) -> torch.Tensor:
    """[L, R] True where slot l's adapter has rank index r (ranks mixed 1..64)."""
    ranks = torch.tensor([RANKS[slot % len(RANKS)] for slot in range(num_slots)])
    return torch.arange(max_rank)[None, :] < ranks[:, None]


def _weights(case: Case, num_slots: int, gen: torch.Generator):
    max_rank = max(RANKS)
    mask = _rank_mask(num_slots, max_rank)
    a = torch.randn(len(case.widths), num_slots, max_rank, case.hidden, generator=gen)
    a = a * mask[None, :, :, None] / case.hidden**0.5
    b = torch.randn(num_slots, sum(case.widths), max_rank, generator=gen) * 0.1
    b = b * mask[:, None, :]
    return a.to(case.dtype), b.to(case.dtype)


def _batch(case: Case, num_slots: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_slots = max(num_slots, case.num_tokens) if case.popularity == "distinct" else num_slots
    slots = _slots(case, num_slots, gen)
    x = torch.randn(slots.numel(), case.hidden, generator=gen).to(case.dtype)
    out = torch.randn(slots.numel(), sum(case.widths), generator=gen).to(case.dtype)
    return x, *_weights(case, num_slots, gen), slots, out


def _assert_shrink_expand(case, x, a, b, slots, out, tolerances):
    tol = tolerances[case.dtype]
    mapping = LoRAMapping.from_slots(slots)
    y = lora_ops.lora_shrink(x, a, mapping, scale=0.5)
    y_ref = reference.lora_shrink(x, a, slots, scale=0.5)
    torch.testing.assert_close(y, y_ref, **tol)
    got, want = out.clone(), out.clone()
    lora_ops.lora_expand(y_ref, b, mapping, got, case.widths)
    reference.lora_expand(y_ref, b, slots, want, case.widths)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    base = slots == -1
    assert torch.equal(y[:, base], torch.zeros_like(y[:, base]))
    assert torch.equal(got[base], out[base]), "rows of slot -1 must be untouched"


@pytest.mark.usefixtures("triton_interpret")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_shrink_expand_match_reference(case, tolerances):
    x, a, b, slots, out = _batch(case)
    _assert_shrink_expand(case, x, a, b, slots, out, tolerances)


@pytest.mark.usefixtures("triton_interpret")
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_slot_minus_one_never_reads_the_last_slot(dtype, tolerances):
    case = Case(dtype, 576, 40, "uniform", (64, 32, 32), base_share=0.4)
    x, a, b, slots, out = _batch(case)
    last = a.shape[1] - 1
    slots = torch.where(slots == last, 0, slots)
    a[:, last] = float("nan")
    b[last] = float("nan")
    _assert_shrink_expand(case, x, a, b, slots, out, tolerances)
    y = kernels.lora_shrink(x, a, slots)
    kernels.lora_expand(y, b, slots, out, case.widths)
    assert not out.isnan().any() and not y.isnan().any()


@pytest.mark.usefixtures("triton_interpret")
def test_shrink_overwrites_out_and_uses_the_dispatch():
    case = Case(F32, 576, 5, "uniform", (64,), base_share=0.5)
    x, a, _, slots, _ = _batch(case)
    y = torch.full((1, 5, a.shape[2]), float("nan"))
    assert kernels.lora_shrink(x, a, slots.tolist(), 2.0, out=y) is y
    torch.testing.assert_close(y, reference.lora_shrink(x, a, slots, 2.0))


@pytest.mark.usefixtures("triton_interpret")
def test_split_k_partials_add_up_and_leave_base_tokens_at_zero():
    # one adapter token among base tokens: one tile, so the reduction is split (4 ways
    # on the CPU), each split into a partial of its own, added in a fixed order
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(5))
    a = torch.randn(1, 4, 16, 1024, generator=torch.Generator().manual_seed(6))
    slots = torch.tensor([-1, 2, -1])
    assert lora_ops.split_k_factor(1, 1024 // 128, x.device) > 1
    y = torch.full((1, 3, 16), float("nan"))
    kernels.lora_shrink(x, a, slots, 0.5, out=y)
    torch.testing.assert_close(y, reference.lora_shrink(x, a, slots, 0.5), rtol=1e-5, atol=1e-4)
    assert not y[:, [0, 2]].any()


def _error_batch():
    case = Case(F32, 64, 4, "uniform", (16, 8))
    return _batch(case, num_slots=3)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda x, a, b, s, o: (x[:, :32], a, b, s, o), "lora_a must have shape"),
        (lambda x, a, b, s, o: (x.half(), a, b, s, o), "lora_a has dtype"),
        (lambda x, a, b, s, o: (x, a, b, torch.tensor([0, 1, 3, -1]), o), "slot 3 is out of range"),
        (lambda x, a, b, s, o: (x, a, b, s[:3], o), "the LoRA mapping has 3 tokens"),
        (lambda x, a, b, s, o: (x.t().contiguous().t(), a, b, s, o), "contiguous in its last"),
        (lambda x, a, b, s, o: (x.int(), a, b, s, o), "x must have dtype"),
    ],
)
def test_shrink_rejects_bad_arguments(mutate, message):
    x, a, b, slots, out = mutate(*_error_batch())
    with pytest.raises(ValueError, match=message):
        lora_ops.lora_shrink(x, a, slots)


@pytest.mark.parametrize(
    "widths, mutate, message",
    [
        ((16, 8), lambda y, b, o: (y, b, o[:, :20]), "out must have shape"),
        ((16, 4), lambda y, b, o: (y, b, o), "must be positive and sum to"),
        ((24,), lambda y, b, o: (y, b, o), "y has 2 slices"),
        ((16, 8), lambda y, b, o: (y.half(), b, o), "y must have dtype"),
        ((16, 8), lambda y, b, o: (y, b[:, :, :7], o), "lora_b must have shape"),
        ((8, 8, 4, 4), lambda y, b, o: (y[:1].expand(4, -1, -1), b, o), "at most 3 slices"),
    ],
)
def test_expand_rejects_bad_arguments(widths, mutate, message):
    x, a, b, slots, out = _error_batch()
    y = reference.lora_shrink(x, a, slots)
    y, b, out = mutate(y, b, out)
    with pytest.raises(ValueError, match=message):
        lora_ops.lora_expand(y, b, slots, out, widths)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device; the interpreter tests cover the kernels",
)
@pytest.mark.parametrize("case", [CASES[2], CASES[5], CASES[8]], ids=str)
def test_cuda_kernels_match_cpu_reference(case, tolerances):
    x, a, b, slots, out = _batch(case)
    tol = tolerances[case.dtype]
    y = kernels.lora_shrink(x.cuda(), a.cuda(), LoRAMapping.from_slots(slots, "cuda"), 0.5)
    torch.testing.assert_close(y.cpu(), reference.lora_shrink(x, a, slots, 0.5), **tol)
    got = out.cuda()
    kernels.lora_expand(y, b.cuda(), slots.cuda(), got, case.widths)
    reference.lora_expand(y.cpu(), b, slots, out, case.widths)
    torch.testing.assert_close(got.cpu().float(), out.float(), **tol)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device; the interpreter tests cover the kernels",
)
def test_cuda_shrink_repeats_bit_for_bit():
    # decode-like: few tiles, so the reduction is split; the partials must add the same
    # way every run (greedy decoding with adapters repeats itself)
    x, a, _, slots, _ = _batch(CASES[1])
    mapping = LoRAMapping.from_slots(slots, "cuda")
    x, a = x.cuda(), a.cuda()
    first = kernels.lora_shrink(x, a, mapping, 0.5)
    for _ in range(20):
        assert torch.equal(kernels.lora_shrink(x, a, mapping, 0.5), first)
