"""The C linear kernel over packed weights against torch's matmul (the Linear layer is tested in
tests/engine/models/test_linear.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels
from tests.support.bf16_paths import PATHS, bf16_path

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernels")

PANEL = cpu_kernels.LINEAR_PANEL


@pytest.fixture(params=PATHS)
def path(request) -> Iterator[str]:
    with bf16_path(request.param):
        yield request.param


def test_pack_layout() -> None:
    """packed[p, k, j] is weight[p * PANEL + j, k]; the last panel is zero past the weight's rows."""
    weight = torch.randn(PANEL + 3, 5)
    packed = cpu_kernels.pack_linear_weight(weight)
    assert packed.shape == (2, 5, PANEL) and packed.is_contiguous()
    assert torch.equal(packed[1, :, 2], weight[PANEL + 2])
    assert torch.equal(packed[0].t(), weight[:PANEL])
    assert not packed[1, :, 3:].any()
    index = torch.tensor([0, PANEL + 2, 7, 7])
    assert torch.equal(cpu_kernels.packed_rows(packed, index, weight.shape[1]), weight[index])


def test_bf16_pack_layout() -> None:
    """bfloat16: packed[p, k // 2, j, k % 2] is weight[p * PANEL + j, k], zero past the rows and past K (padded to 32)."""
    weight = torch.randn(PANEL + 3, 37).bfloat16()
    packed = cpu_kernels.pack_linear_weight(weight)
    assert packed.shape == (2, 32, PANEL, 2) and packed.is_contiguous() and packed.dtype == torch.bfloat16
    assert torch.equal(packed[1, :, 2].reshape(-1)[:37], weight[PANEL + 2])
    assert torch.equal(packed[0, 5, 9, 1], weight[9, 11])
    assert not packed[1, :, 3:].any()  # past the weight's rows
    assert not packed[:, 19:].any() and not packed[:, 18, :, 1].any()  # features 37 .. 63
    index = torch.tensor([0, PANEL + 2, 7, 7])
    assert torch.equal(cpu_kernels.packed_rows(packed, index, 37), weight[index])


def test_bf16_path_follows_the_cpu() -> None:
    """AMX from 16 rows; below (and without AMX) the dot products where the CPU has them and they out-run the
    widened weights' FMAs, else the widened path; capped at ``avx512-bf16``, the dot products wherever they exist."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    dot = "avx512_bf16" in flags
    amx = dot and {"amx_bf16", "amx_tile"} <= flags
    assert cpu_kernels.bf16_linear_path(1) in (("avx512-bf16", "widened") if dot else ("widened",))
    assert cpu_kernels.bf16_linear_path(15) == cpu_kernels.bf16_linear_path(1)
    assert cpu_kernels.bf16_linear_path(16) == ("amx" if amx else cpu_kernels.bf16_linear_path(1))
    with bf16_path("widened"):
        assert cpu_kernels.bf16_linear_path(1) == cpu_kernels.bf16_linear_path(64) == "widened"


def test_bf16_dot_cap_takes_the_dot_products() -> None:
    """Capped at ``avx512-bf16``, every row count takes the dot products, whether or not they out-run the FMAs."""
    with bf16_path("avx512-bf16"):
        assert {cpu_kernels.bf16_linear_path(rows) for rows in (1, 15, 16, 64, 512)} == {"avx512-bf16"}


# Rows: tiles of 6 (up to 12 with AVX-512, or with dot products) and every remainder, AMX's 16 and 32-row blocks
# and partial ones, and past one block of rows (256 KB of x: 113 rows at K=576).
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 11, 13, 16, 17, 40, 64, 250])
@pytest.mark.parametrize("shape", [(576, 960), (21, 13), (64, 48)])  # (in, out): a model's, partial panels and odd K
def test_matches_torch(rows: int, shape: tuple[int, int]) -> None:
    """float32: equal to F.linear in float64 terms, with and without bias."""
    _check_linear(rows, shape, torch.float32, "widened")


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 11, 13, 16, 17, 40, 64, 250, 500])  # 500: past AMX's 224-row block
@pytest.mark.parametrize("shape", [(576, 960), (21, 13), (64, 48)])
def test_bf16_matches_torch(rows: int, shape: tuple[int, int], path: str) -> None:
    """bfloat16, each path: F.linear in float64 of the exactly widened weight, and of x rounded to bfloat16 where
    the path computes with the CPU's bfloat16 products."""
    _check_linear(rows, shape, torch.bfloat16, path)


def _check_linear(rows: int, shape: tuple[int, int], weight_dtype: torch.dtype, path: str) -> None:
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
    bias = torch.randn(out_features, generator=gen)
    packed = cpu_kernels.pack_linear_weight(weight)
    x_used = x if path == "widened" else x.bfloat16()
    for b in (None, bias):
        out = cpu_kernels.linear(x, packed, out_features, b)
        expected = F.linear(x_used.double(), weight.double(), None if b is None else b.double())
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
    with pytest.raises(ValueError, match=r"x \[2, 15\] needs a weight packed by pack_linear_weight for 8 outputs"):
        cpu_kernels.linear(torch.randn(2, 15), packed, 8)
    with pytest.raises(ValueError, match=r"bias must have shape \[8\]"):
        cpu_kernels.linear(torch.randn(2, 16), packed, 8, torch.randn(9))
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.linear(torch.randn(2, 16, dtype=torch.float64), packed, 8)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensor"):
        cpu_kernels.pack_linear_weight(torch.randn(8, 16).half())
