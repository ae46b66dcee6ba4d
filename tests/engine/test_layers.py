"""PackedLinear against F.linear on both sides of its skinny-product threshold."""

import pytest
import torch
import torch.nn.functional as F

from lorapool.engine.models.layers import SKINNY_TOKENS, PackedLinear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 7, SKINNY_TOKENS, SKINNY_TOKENS + 1, 600])
def test_packed_linear_matches_f_linear(tokens, bias):
    gen = torch.Generator().manual_seed(tokens)
    layer = PackedLinear(96, [64, 32, 32], bias, torch.float32)
    layer.weight.data.copy_(torch.randn(128, 96, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(128, generator=gen))
    x = torch.randn(tokens, 96, generator=gen)
    expected = F.linear(x, layer.weight, layer.bias)
    out = layer(x)
    assert out.shape == (tokens, 128)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # The result takes a LoRA delta in place (index_add_ on rows) as F.linear's does.
    rows = torch.arange(0, tokens, 2)
    delta = torch.randn(len(rows), 128, generator=gen)
    torch.testing.assert_close(
        out.index_add_(0, rows, delta), expected.index_add_(0, rows, delta), rtol=1e-5, atol=1e-5
    )
