"""Linear layers: the C kernel for a few rows, the transposed CPU matmul for small batches, bfloat16 weights
widened for float32 input, fused shards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_kernels import SKINNY_MAX_ROWS
from engine.layers import linear
from engine.layers.linear import TRANSPOSED_MATMUL_MAX_ROWS, Linear, MergedLinear

ROWS = [1, 2, 7, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, TRANSPOSED_MATMUL_MAX_ROWS, TRANSPOSED_MATMUL_MAX_ROWS + 1, 300]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_matches_f_linear_at_every_batch_size(rows: int, bias: bool, weight_dtype: torch.dtype) -> None:
    """Every side of the row thresholds (C kernel, transposed matmul, x W^T) gives x W^T + b, also for a
    strided (transposed-view) input; a bfloat16 weight gives the product of its exact float32 widening."""
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(48, 80, bias=bias)
    torch.nn.init.normal_(layer.weight, generator=gen)
    if bias:
        torch.nn.init.normal_(layer.bias, generator=gen)
    layer.weight.data = layer.weight.data.to(weight_dtype)
    x = torch.randn(rows, 48, generator=gen)
    strided = torch.randn(48, rows, generator=gen).t()
    for inp in (x, strided):
        y = layer(inp)
        assert y.shape == (rows, 80) and y.dtype == torch.float32
        torch.testing.assert_close(y, F.linear(inp, layer.weight.float(), layer.bias), atol=1e-4, rtol=1e-5)
    if 1 < rows <= TRANSPOSED_MATMUL_MAX_ROWS:
        assert layer(x).stride() == (1, rows)  # the transposed product itself, no copy


@pytest.mark.parametrize("rows", [SKINNY_MAX_ROWS + 1, TRANSPOSED_MATMUL_MAX_ROWS + 1])
def test_bfloat16_weight_widens_chunk_by_chunk(rows: int, monkeypatch) -> None:
    """A weight widened a few rows at a time (the last chunk short) fills every output column once."""
    monkeypatch.setattr(linear, "WIDEN_CHUNK_ELEMENTS", 3 * 48)  # chunks of 3 rows of 48
    weight, bias = torch.randn(20, 48).bfloat16(), torch.randn(20)
    x = torch.randn(rows, 48)
    expected = F.linear(x, weight.float(), bias)
    torch.testing.assert_close(linear.widened_linear(x, weight, bias), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(linear.widened_linear(x, weight), expected - bias, atol=1e-4, rtol=1e-5)


def test_other_dtypes_keep_f_linear() -> None:
    """The transposed form is measured for float32 only; bfloat16 keeps x W^T (contiguous rows)."""
    layer = Linear(16, 8).bfloat16()
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    y = layer(x)
    assert y.is_contiguous()
    assert torch.equal(y, F.linear(x, layer.weight))


def test_merged_shards_split_and_load() -> None:
    """Each checkpoint shard lands in its rows; split returns the shards' outputs."""
    layer = MergedLinear(4, {"q": 3, "k": 2})
    wq, wk = torch.randn(3, 4), torch.randn(2, 4)
    layer.weight_loader(layer.weight, wq, "q")
    layer.weight_loader(layer.weight, wk, "k")
    x = torch.randn(5, 4)
    q, k = layer.split(layer(x))
    torch.testing.assert_close(q, x @ wq.T)
    torch.testing.assert_close(k, x @ wk.T)
    with pytest.raises(ValueError, match="shape"):
        layer.weight_loader(layer.weight, torch.randn(3, 5), "q")
