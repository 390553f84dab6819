"""The C linear kernel for a few rows against torch's matmul (the Linear layer's paths are tested in
tests/engine/models/test_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernels")


@pytest.mark.parametrize("rows", [1, 2, 3, 7, cpu_kernels.SKINNY_MAX_ROWS])  # passes of 3 rows, and what remains
@pytest.mark.parametrize("col_major", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(576, 960), (20, 13)])  # (in, out): a model's, and neither a multiple of 8 nor 4
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_matches_torch(
    rows: int, col_major: bool, with_bias: bool, shape: tuple[int, int], weight_dtype: torch.dtype
) -> None:
    """Equal to F.linear in float64 terms (of the exactly widened weight, in bfloat16), for either input layout;
    the output is the column-major view."""
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(in_features, rows, generator=gen)
    x = x.t() if col_major else x.t().contiguous()
    weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    out = cpu_kernels.skinny_linear(x, weight, bias)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)
    assert out.shape == (rows, out_features) and out.stride() == (1, rows)


def test_broadcast_rows_are_read_as_rows() -> None:
    """An expanded input (every row the same storage) gives the rows' products, not a read past them."""
    x, weight = torch.randn(1, 24).expand(3, 24), torch.randn(10, 24)
    torch.testing.assert_close(cpu_kernels.skinny_linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_rejects_what_it_cannot_serve() -> None:
    weight = torch.randn(8, 16)
    with pytest.raises(ValueError, match=f"1 to {cpu_kernels.SKINNY_MAX_ROWS} rows"):
        cpu_kernels.skinny_linear(torch.randn(cpu_kernels.SKINNY_MAX_ROWS + 1, 16), weight)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.skinny_linear(torch.randn(2, 15), weight)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.skinny_linear(torch.randn(2, 16, dtype=torch.float64), weight)
    with pytest.raises(ValueError, match="weight must be a float32 or bfloat16"):
        cpu_kernels.skinny_linear(torch.randn(2, 16), weight.half())
