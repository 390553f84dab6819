"""The C linear kernel over packed weights against torch's matmul (the Linear layer is tested in
tests/engine/models/test_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernels")

PANEL = cpu_kernels.LINEAR_PANEL


def test_pack_layout() -> None:
    """packed[p, k, j] is weight[p * PANEL + j, k]; the last panel is zero past the weight's rows."""
    weight = torch.randn(PANEL + 3, 5)
    packed = cpu_kernels.pack_linear_weight(weight)
    assert packed.shape == (2, 5, PANEL) and packed.is_contiguous()
    assert torch.equal(packed[1, :, 2], weight[PANEL + 2])
    assert torch.equal(packed[0].t(), weight[:PANEL])
    assert not packed[1, :, 3:].any()
    index = torch.tensor([0, PANEL + 2, 7, 7])
    assert torch.equal(cpu_kernels.packed_rows(packed, index), weight[index])


# Rows: tiles of 6 and every remainder, and past one block of rows (256 KB of x: 113 rows at K=576).
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 11, 64, 250])
@pytest.mark.parametrize("shape", [(576, 960), (20, 13)])  # (in, out): a model's, and a partial panel
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_matches_torch(rows: int, shape: tuple[int, int], weight_dtype: torch.dtype) -> None:
    """Equal to F.linear in float64 terms (of the exactly widened weight, in bfloat16), with and without bias."""
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
    bias = torch.randn(out_features, generator=gen)
    packed = cpu_kernels.pack_linear_weight(weight)
    for b in (None, bias):
        out = cpu_kernels.linear(x, packed, out_features, b)
        expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert out.shape == (rows, out_features) and out.is_contiguous()
        torch.testing.assert_close(out.double(), expected, atol=2e-4, rtol=1e-5)


def test_strided_and_broadcast_inputs() -> None:
    """A column-major view, a slice of wider rows and an expanded row are read as the rows they show."""
    weight = torch.randn(40, 24)
    packed = cpu_kernels.pack_linear_weight(weight)
    for x in (torch.randn(24, 9).t(), torch.randn(9, 30)[:, 3:27], torch.randn(1, 24).expand(3, 24)):
        torch.testing.assert_close(cpu_kernels.linear(x, packed, 40), F.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_rejects_what_it_cannot_serve() -> None:
    packed = cpu_kernels.pack_linear_weight(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"packed float32 or bfloat16 weight of shape \[1, 15, 16\]"):
        cpu_kernels.linear(torch.randn(2, 15), packed, 8)
    with pytest.raises(ValueError, match=r"bias must have shape \[8\]"):
        cpu_kernels.linear(torch.randn(2, 16), packed, 8, torch.randn(9))
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.linear(torch.randn(2, 16, dtype=torch.float64), packed, 8)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensor"):
        cpu_kernels.pack_linear_weight(torch.randn(8, 16).half())
