"""Paged KV cache writes and paged attention: Triton kernels against the reference.

Caches start full of NaN, so a kernel that reads a slot no token was written
to (the tail of a last block, a padding block-table entry, blocks 0 and the
last, which no sequence owns) shows up as NaN in the output.
"""

from dataclasses import dataclass

import pytest
import torch

from lorapool import kernels
from lorapool.kernels import attention_ops, kv_cache_ops, reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@dataclass(frozen=True)
class Batch:
    seqs: tuple[tuple[int, int], ...]  # (new tokens, context length incl. them) per sequence
    group: int  # query heads per KV head (GQA ratio)
    block_size: int
    dtype: torch.dtype
    head_size: int = 64
    num_kv_heads: int = 2

    def __str__(self):
        seqs = "_".join(f"{q}of{c}" for q, c in self.seqs)
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}-g{self.group}-bs{self.block_size}-d{self.head_size}-{seqs}"


DECODE = [
    Batch(((1, 1), (1, 17), (1, 100), (1, 33)), 1, 16, F32),
    Batch(((1, 5), (1, 64), (1, 200)), 3, 32, F16),
    Batch(((1, 40), (1, 1)), 8, 16, BF16, head_size=128, num_kv_heads=1),
    Batch(((1, 1000), (1, 3)), 3, 16, F16),  # split over 4 programs, 3 of them empty for one
    Batch(((1, 700), (1, 260)), 8, 32, BF16, num_kv_heads=1),  # split in 3
]
PREFILL = [
    Batch(((37, 37), (16, 16)), 3, 16, F32),
    Batch(((20, 70), (1, 45), (9, 9)), 8, 32, F16, head_size=80),
    Batch(((50, 130), (1, 300)), 1, 32, BF16),
    Batch(((0, 5), (3, 8), (1, 4)), 3, 16, F32),  # a sequence with no new token
    Batch(((2, 6), (0, 3), (1, 9)), 1, 32, F16),  # as many tokens as sequences, not all decode
]


def _tables(batch: Batch, gen: torch.Generator):
    """Random block tables, padded with -1; blocks 0 (a freed block that padding
    may gather) and the last belong to no one."""
    counts = [-(-ctx // batch.block_size) for _, ctx in batch.seqs]
    num_blocks = sum(counts) + 2
    perm = (torch.randperm(num_blocks - 2, generator=gen) + 1).tolist()
    tables = torch.full((len(counts), max(counts) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(counts):
        tables[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return tables, num_blocks


def _slots(tables: torch.Tensor, b: int, start: int, end: int, block_size: int):
    pos = torch.arange(start, end)
    return tables[b, pos // block_size].long() * block_size + pos % block_size


def _make(batch: Batch, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _tables(batch, gen)
    shape = (num_blocks, batch.block_size, batch.num_kv_heads, batch.head_size)
    k_cache = torch.full(shape, float("nan"), dtype=batch.dtype)
    v_cache = k_cache.clone()
    for b, (_, ctx) in enumerate(batch.seqs):
        k, v = (torch.randn(ctx, *shape[2:], generator=gen).to(batch.dtype) for _ in range(2))
        reference.write_kv_cache(
            k, v, k_cache, v_cache, _slots(tables, b, 0, ctx, batch.block_size)
        )
    q_lens = torch.tensor([q for q, _ in batch.seqs])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    num_heads = batch.num_kv_heads * batch.group
    q = torch.randn(int(q_lens.sum()), num_heads, batch.head_size, generator=gen)
    seq_lens = torch.tensor([c for _, c in batch.seqs], dtype=torch.int32)
    return q.to(batch.dtype), k_cache, v_cache, tables, seq_lens, qsl


@pytest.mark.usefixtures("triton_interpret")
@pytest.mark.parametrize("batch", DECODE + PREFILL, ids=str)
def test_paged_attention_matches_reference(batch, tolerances):
    args = _make(batch)
    scale = batch.head_size**-0.5
    got = attention_ops.paged_attention(*args, scale)
    want = reference.paged_attention(*args, scale)
    assert not want.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **tolerances[batch.dtype])


# Launch configs the GPU kit's sweep tries: the result is the reference's whatever the
# tiles, splits and warps (a decode split in 1, 4 and 16; a prefill never splits).
CONFIGS = [
    {},
    {"block_n": 32, "num_splits": 4, "num_warps": 8, "num_stages": 2},
    {"block_n": 128, "num_splits": 16},
    {"num_splits": 1},
]


@pytest.mark.usefixtures("triton_interpret")
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("batch", [DECODE[3], PREFILL[1]], ids=str)
def test_paged_attention_launch_configs_match_reference(batch, config, tolerances):
    args = _make(batch)
    scale = batch.head_size**-0.5
    got = attention_ops.paged_attention(*args, scale, config=config)
    want = reference.paged_attention(*args, scale)
    torch.testing.assert_close(got.float(), want.float(), **tolerances[batch.dtype])


def test_paged_attention_config_keys_and_candidates():
    key = attention_ops.config_key(64, 64, 32, 8, 64, 4096, torch.bfloat16)
    assert key == "decode-h32-kv8-d64-bfloat16-t64-c4096"
    assert attention_ops.config_key(100, 3, 32, 8, 64, 300, torch.float16).startswith("prefill")
    configs = attention_ops.candidates()
    assert configs and all(set(c) <= set(attention_ops.CONFIG_KEYS) for c in configs)
    assert {c["num_splits"] for c in attention_ops.candidates(block_q=4)} == {1}
    args = _make(DECODE[0])
    with pytest.raises(ValueError, match="unknown paged_attention config keys"):
        attention_ops.paged_attention(*args, 0.1, config={"BLOCK_K": 64})


# Decode rows padded to the longest of their group, and prefill beside decode.
POISONED = [
    Batch(((1, 100), (1, 90), (1, 83), (1, 3)), 2, 16, F32),
    Batch(((20, 70), (1, 64), (1, 60)), 3, 16, F32),
]
POISONS = [float("nan"), float("inf"), float("-inf")]


def _poisoned(batch: Batch, fill: float):
    """The arguments of ``_make`` twice: free slots zero (clean), then set to ``fill``."""
    q, k_cache, v_cache, *rest = _make(batch)
    free = k_cache.isnan()  # written slots hold randn, never NaN
    clean = [c.masked_fill(free, 0.0) for c in (k_cache, v_cache)]
    poisoned = [c.masked_fill(free, fill) for c in (k_cache, v_cache)]
    return (q, *clean, *rest), (q, *poisoned, *rest)


@pytest.mark.parametrize("fill", POISONS, ids=str)
@pytest.mark.parametrize("batch", POISONED, ids=str)
def test_reference_ignores_what_free_slots_hold(batch, fill):
    clean, poisoned = _poisoned(batch, fill)
    scale = batch.head_size**-0.5
    want = reference.paged_attention(*clean, scale)
    torch.testing.assert_close(reference.paged_attention(*poisoned, scale), want, rtol=0, atol=0)


@pytest.mark.usefixtures("triton_interpret")
@pytest.mark.parametrize("fill", POISONS, ids=str)
@pytest.mark.parametrize("batch", POISONED, ids=str)
def test_kernel_ignores_what_free_slots_hold(batch, fill, tolerances):
    clean, poisoned = _poisoned(batch, fill)
    scale = batch.head_size**-0.5
    got = attention_ops.paged_attention(*poisoned, scale)
    torch.testing.assert_close(got, attention_ops.paged_attention(*clean, scale), rtol=0, atol=0)
    want = reference.paged_attention(*clean, scale)
    torch.testing.assert_close(got, want, **tolerances[batch.dtype])


@dataclass(frozen=True)
class Write:
    dtype: torch.dtype
    cache_dtype: torch.dtype
    block_size: int
    num_kv_heads: int
    head_size: int


@pytest.mark.usefixtures("triton_interpret")
@pytest.mark.parametrize(
    "case",
    [
        Write(F32, F32, 16, 2, 64),
        Write(F16, F16, 32, 3, 80),
        Write(BF16, BF16, 16, 1, 128),
        Write(F32, F16, 32, 4, 64),
    ],
    ids=lambda c: f"{c.dtype}->{c.cache_dtype}-bs{c.block_size}-h{c.num_kv_heads}-d{c.head_size}",
)
def test_write_kv_cache_matches_reference(case):
    gen = torch.Generator().manual_seed(1)
    num_tokens, width = 37, case.num_kv_heads * case.head_size
    qkv = torch.randn(num_tokens, 4 * width, generator=gen).to(case.dtype)  # k, v are views
    k = qkv[:, width : 2 * width].view(num_tokens, case.num_kv_heads, case.head_size)
    v = qkv[:, 3 * width :].view(num_tokens, case.num_kv_heads, case.head_size)
    shape = (8, case.block_size, case.num_kv_heads, case.head_size)
    slots = torch.randperm(8 * case.block_size, generator=gen)[:num_tokens]
    caches = [torch.full(shape, float("nan"), dtype=case.cache_dtype) for _ in range(4)]
    kv_cache_ops.write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True, rtol=0, atol=0)


@pytest.mark.usefixtures("triton_interpret")
def test_write_kv_cache_skips_negative_slots():
    k = torch.randn(3, 1, 16)
    caches = [torch.zeros(2, 16, 1, 16) for _ in range(2)]
    kernels.write_kv_cache(k, k, *caches, torch.tensor([5, -1, 31], dtype=torch.int32))
    flat = caches[0].view(32, 1, 16)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[31], k[2])
    assert flat.count_nonzero() == 2 * 16


def test_only_small_decode_batches_split_the_context():
    cpu = torch.device("cpu")
    assert attention_ops.kv_splits(4, 1, 1024, 64, cpu) == (4, 256)
    assert attention_ops.kv_splits(2, 1, 736, 64, cpu) == (3, 256)
    assert attention_ops.kv_splits(4, 1, 128, 64, cpu)[0] == 1  # short contexts
    assert attention_ops.kv_splits(2, 21, 1024, 64, cpu)[0] == 1  # prefill


def _attention_args():
    return _make(Batch(((1, 20), (3, 9)), 2, 16, F32))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda q, k, v, t, s, l: (q[:, :3], k, v, t, s, l), "not a multiple of"),
        (lambda q, k, v, t, s, l: (q.half(), k, v, t, s, l), "query must have dtype"),
        (lambda q, k, v, t, s, l: (q, k, v.half(), t, s, l), "value_cache has dtype"),
        (lambda q, k, v, t, s, l: (q, k[:, :12], v[:, :12], t, s, l), "power of two"),
        (lambda q, k, v, t, s, l: (q, k, v, t.float(), s, l), "block_tables must have dtype"),
        (lambda q, k, v, t, s, l: (q, k, v, t, s, l[:2]), "query_start_loc must have shape"),
        (lambda q, k, v, t, s, l: (q, k, v, t[:1], s, l), "block_tables must have shape"),
    ],
)
def test_paged_attention_rejects_bad_arguments(mutate, message):
    args = mutate(*_attention_args())
    with pytest.raises(ValueError, match=message):
        attention_ops.paged_attention(*args, 0.1)


def test_write_kv_cache_rejects_bad_arguments():
    k = torch.randn(3, 2, 16)
    cache = torch.zeros(2, 16, 2, 16)
    with pytest.raises(ValueError, match="key must have shape"):
        kv_cache_ops.write_kv_cache(k[:, :1], k, cache, cache, torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        kv_cache_ops.write_kv_cache(k, k, cache, cache, torch.arange(3.0))


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device; the interpreter tests cover the kernels",
)
@pytest.mark.parametrize("batch", [DECODE[1], DECODE[3], PREFILL[1], PREFILL[2]], ids=str)
def test_cuda_kernels_match_cpu_reference(batch, tolerances):
    args = _make(batch)
    scale = batch.head_size**-0.5
    got = kernels.paged_attention(*(a.cuda() for a in args), scale)
    want = reference.paged_attention(*args, scale)
    torch.testing.assert_close(got.cpu().float(), want.float(), **tolerances[batch.dtype])
