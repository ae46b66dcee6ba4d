"""The CPU decode attention, gathered in groups of similar length, against plain math."""

import pytest
import torch

from lorapool.kernels import AttentionPlan, reference


def _naive(query, key_cache, value_cache, table, length, scale):
    # query: [Hq, D]; one sequence's context read block by block, softmax written out
    kv_heads = key_cache.shape[2]
    k = torch.cat([key_cache[int(b)] for b in table])[:length].double()  # [L, Hkv, D]
    v = torch.cat([value_cache[int(b)] for b in table])[:length].double()
    group = query.shape[0] // kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", query.double(), k) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("fill", [0.0, float("nan"), float("inf")])
def test_decode_rows_of_spread_lengths_match_per_sequence_attention(fill):
    gen = torch.Generator().manual_seed(3)
    block_size, kv_heads, head_size, group = 16, 3, 32, 3
    # lengths from 1 to 700 in no order: several length groups, single rows among them
    lens = [700, 1, 17, 650, 40, 333, 16, 15, 512, 100, 99, 2, 300, 690, 64, 65]
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 1
    shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache, value_cache = torch.full(shape, fill), torch.full(shape, fill)  # unwritten slots
    perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables = torch.full((len(lens), max(counts)), num_blocks - 1, dtype=torch.int32)
    for b, (n, c) in enumerate(zip(lens, counts)):
        tables[b, :c] = torch.tensor(perm[:c], dtype=torch.int32)
        perm = perm[c:]
        for p in range(n):
            block, offset = int(tables[b, p // block_size]), p % block_size
            key_cache[block, offset] = torch.randn(kv_heads, head_size, generator=gen)
            value_cache[block, offset] = torch.randn(kv_heads, head_size, generator=gen)
    query = torch.randn(len(lens), kv_heads * group, head_size, generator=gen)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    scale = head_size**-0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = AttentionPlan.build(tables, seq_lens, starts, block_size)
    assert len(plan.decode) > 3
    args = (query, key_cache, value_cache, tables, seq_lens, starts, scale)
    out = reference.paged_attention(*args)
    # a plan built once and passed in, as the engine does for its layers, gives the same
    planned = reference.paged_attention(*args, plan=plan)
    torch.testing.assert_close(planned, out, rtol=0, atol=0)
    for b, n in enumerate(lens):
        expected = _naive(query[b], key_cache, value_cache, tables[b, : counts[b]], n, scale)
        torch.testing.assert_close(out[b], expected, rtol=1e-5, atol=1e-5)
