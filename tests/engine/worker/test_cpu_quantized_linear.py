"""int8 weights (``quantization="int8"``): min/max blocks, the panel layout, and the C kernel over it against a
float64 matmul of the dequantized weight. (A GGUF file's own blocks: test_cpu_ggml_linear.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import cpu_kernels
from engine.layers import quantization as q
from tests.support.bf16_paths import PATHS, bf16_path

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernels")

def test_pack_layout_and_rows() -> None:
    """Panels interleave 16 columns per input feature; rows() reads any row back, the last panel's padding
    included nowhere."""
    weight = torch.from_numpy(np.random.default_rng(2).standard_normal((cpu_kernels.LINEAR_PANEL + 5, 64)).astype(np.float32))
    blocks = q.quantize_int8(weight)
    packed = q.pack(blocks)
    assert packed.codes.shape == (2, 2, q.QBLOCK, cpu_kernels.LINEAR_PANEL)
    assert int(packed.codes[1, 1, 8, 3]) == int(blocks.codes[cpu_kernels.LINEAR_PANEL + 3, 40])
    index = torch.arange(weight.shape[0])
    assert torch.equal(packed.rows(index), blocks.dequantize())
    assert packed.nbytes == packed.codes.nbytes + packed.scales.nbytes


# Rows: the factored tile (1..3), the widening tile (4..6), the dequantized-panel path (7+), past one block
# of x rows at K=576.
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 6, 7, 40, 250])
@pytest.mark.parametrize("shape", [(576, 200), (64, 13)])  # (in, out): a partial last panel in both
def test_kernel_matches_float64(rows: int, shape: tuple[int, int]) -> None:
    """x W^T + b over packed blocks equals float64's of the dequantized weight, with and without bias."""
    in_features, out_features = shape
    rng = np.random.default_rng(rows + in_features)
    weight = rng.standard_normal((out_features, in_features)).astype(np.float32)
    blocks = q.quantize_int8(torch.from_numpy(weight))
    reference = blocks.dequantize()
    packed = q.pack(blocks)
    x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(out_features).astype(np.float32))
    expected = x.double() @ reference.double().T
    assert torch.allclose(cpu_kernels.linear_quantized(x, packed).double(), expected, atol=1e-4, rtol=1e-5)
    with_bias = cpu_kernels.linear_quantized(x, packed, bias).double()
    assert torch.allclose(with_bias, expected + bias.double(), atol=1e-4, rtol=1e-5)


def test_int8_blocks_round_to_nearest() -> None:
    """Each block spans its least to its greatest weight in 255 steps, every weight within half a step of its
    code's value (the extremes exact); a constant block is exact."""
    weight = torch.randn(8, 64)
    weight[3, :32] = 0.25
    blocks = q.quantize_int8(weight)
    view = weight.view(8, 2, 32)
    step = (view.amax(-1) - view.amin(-1)) / 255
    assert torch.equal(blocks.d, step) and torch.equal(blocks.m, view.amin(-1))
    error = (blocks.dequantize() - weight).view(8, 2, 32).abs()
    assert bool((error <= step.unsqueeze(-1) / 2 + 1e-6).all())
    assert torch.equal(blocks.dequantize()[3, :32], weight[3, :32])
    assert blocks.codes.dtype == torch.uint8 and int(blocks.codes.max()) == 255 and int(blocks.codes.min()) == 0


def test_bad_shapes_are_named() -> None:
    """A weight whose in_features is not a multiple of 32, an input of the wrong width, a bias of the wrong size."""
    with pytest.raises(ValueError, match="divisible by 32"):
        q.quantize_int8(torch.randn(4, 40))
    packed = q.pack(q.quantize_int8(torch.randn(4, 64)))
    with pytest.raises(ValueError, match="64 in_features"):
        cpu_kernels.linear_quantized(torch.randn(2, 32), packed)
    with pytest.raises(ValueError, match=r"bias must have shape \[4\]"):
        cpu_kernels.linear_quantized(torch.randn(2, 64), packed, torch.randn(5))


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40, 250, 500])  # 500: past AMX's 224-row block at K=576
@pytest.mark.parametrize("shape", [(576, 200), (64, 13), (96, 48)])  # partial, one and whole panel pairs
@pytest.mark.parametrize("path", PATHS)
def test_bf16_products_match_float64(rows: int, shape: tuple[int, int], path: str) -> None:
    """With bf16_products, past QUANTIZED_FLOAT_ROWS rows on a bfloat16 path (AMX from 16 rows, VDPBF16PS where
    the CPU has it) the kernel gives float64's product of x and the dequantized weight both rounded to bfloat16;
    every other row count and path gives the float32 kernel's."""
    in_features, out_features = shape
    rng = np.random.default_rng(rows + in_features + 7)
    weight = rng.standard_normal((out_features, in_features)).astype(np.float32)
    blocks = q.quantize_int8(torch.from_numpy(weight))
    reference = blocks.dequantize()
    packed = q.pack(blocks)._replace(bf16_products=True)
    x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(out_features).astype(np.float32))
    with bf16_path(path):
        taken = cpu_kernels.bf16_linear_path(rows)
        rounded = taken != "widened" and rows > cpu_kernels.QUANTIZED_FLOAT_ROWS
        out = cpu_kernels.linear_quantized(x, packed, bias).double()
    if rounded:  # the kernel's dequantization is fused (d q + m rounded once), then rounded to bfloat16
        n, k = blocks.codes.shape
        exact = blocks.codes.double().view(n, k // q.QBLOCK, q.QBLOCK) * blocks.d.double().unsqueeze(-1)
        fused = (exact + blocks.m.double().unsqueeze(-1)).float().view(n, k)
        x, reference = x.bfloat16(), fused.bfloat16()
    expected = x.double() @ reference.double().T + bias.double()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
