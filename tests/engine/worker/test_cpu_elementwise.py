"""The C element-wise kernels (RMSNorm, rotary, SiLU-and-mul) equal the layers' PyTorch paths, for row-major and
column-major inputs."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_kernels
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_inv_freq

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernels")

ROWS = [1, 3, 64, 300]  # one thread for the first two, two for the others


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch):
    """Runs a callable with the kernels switched off, so the layers take their PyTorch path."""

    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(cpu_kernels, "serves", lambda x: False)
            return fn(*args)

    return run


def _rows(num_rows: int, width: int, col_major: bool, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[num_rows, width] row-major, or a column-major view (the kernels read it as copied rows)."""
    gen = torch.Generator().manual_seed(seed)
    if col_major:
        return (torch.randn(width, num_rows, generator=gen) * scale).t()
    return torch.randn(num_rows, width, generator=gen) * scale


@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("col_major", [False, True])
def test_rms_norm(num_rows: int, col_major: bool, native) -> None:
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576, generator=torch.Generator().manual_seed(1))
    x, residual = _rows(num_rows, 576, col_major, 2), _rows(num_rows, 576, not col_major, 3)
    out, residual_out = norm(x, residual)
    ref_out, ref_residual = native(norm, x, residual)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(residual_out, ref_residual, atol=0, rtol=0)
    assert out.is_contiguous()
    torch.testing.assert_close(norm(x), native(norm, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("col_major", [False, True])
def test_silu_and_mul(num_rows: int, col_major: bool, native) -> None:
    x = _rows(num_rows, 2 * 1539, col_major, 4, scale=8.0)  # an intermediate size that leaves a vector tail
    x[0, :6] = torch.tensor([-100.0, -40.0, -0.5, 0.0, 40.0, 100.0])  # both sides of the exp cut-off
    act = SiluAndMul()
    out = act(x)
    torch.testing.assert_close(out, native(act, x), atol=1e-5, rtol=1e-5)
    assert out.is_contiguous()


@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("col_major", [False, True])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary(num_rows: int, col_major: bool, partial: float, native) -> None:
    class Config:
        rope_parameters = {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": partial}

    rotary = RotaryEmbedding(64, rope_inv_freq(Config(), 64), max_position=4096)
    rotary.materialize(torch.device("cpu"), torch.float32)
    qkv = _rows(num_rows, 9 * 64 + 2 * 3 * 64, col_major, 5)  # the fused projection's output, as in the model
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(-1, 9, 64), k.view(-1, 3, 64)
    positions = torch.randint(0, 4096, (num_rows,), generator=torch.Generator().manual_seed(6))
    out_q, out_k = rotary(positions, q, k)
    ref_q, ref_k = native(rotary, positions, q, k)
    torch.testing.assert_close(out_q, ref_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_k, ref_k, atol=1e-6, rtol=1e-6)
    with pytest.raises(IndexError, match="outside the rotary table's 4096 positions"):
        rotary(torch.full((num_rows,), 4096), q, k)


def test_attention_reads_strided_queries() -> None:
    """Queries in a column-major view give the same attention as contiguous ones (read in place)."""
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache = torch.randn(2, 8, 16, 3, 64, generator=gen)
    block_tables = torch.arange(8, dtype=torch.int32).view(4, 2)
    seq_lens = torch.tensor([32, 17, 5, 30])
    q = torch.randn(9 * 64, 4, generator=gen).t().view(4, 9, 64)
    assert not q.is_contiguous()
    out = cpu_kernels.attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
    expected = cpu_kernels.attention(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
