"""The CPU reference's finite_cache shortcut gives the guarded path's result."""

import torch

from lorapool.kernels import reference


def test_finite_cache_shortcut_matches_the_guarded_path():
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, head_size = 64, 16, 3, 32
    # Stale, finite values everywhere, as in an engine's reused blocks.
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen) * 5
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=gen) * 5
    lens = torch.tensor([1, 17, 40, 100, 33], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:7] for _ in lens]).int()
    query = torch.randn(len(lens), 9, head_size, generator=gen)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    args = (query, key_cache, value_cache, tables, lens, starts, head_size**-0.5)
    guarded = reference.paged_attention(*args)
    fast = reference.paged_attention(*args, finite_cache=True)
    torch.testing.assert_close(fast, guarded, rtol=1e-5, atol=1e-5)
