"""Int8 products (``quantization="w8a8"``): the rotation of the blocks, the layout ``pack`` writes for them, the
activations' int8 blocks, and the kernel on each path this CPU has against float64's product of the quantized
activations and weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from engine import cpu_kernels
from engine.layers import quantization as q

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernels")

PATHS = cpu_kernels.INT8_LINEAR_PATHS


@contextlib.contextmanager
def int8_path(name: str) -> Iterator[None]:
    """Cap the int8 products at ``name`` (``pytest.skip`` where this CPU lacks it), the highest restored after."""
    cap = cpu_kernels.library().linear_int8_limit
    cap(PATHS.index(name))
    try:
        if cpu_kernels.int8_linear_path() != name:
            pytest.skip(f"this CPU has no {name} path")
        yield
    finally:
        cap(len(PATHS) - 1)


def _rotated(x: torch.Tensor) -> torch.Tensor:
    """x's blocks of 32 times the Hadamard matrix, by the kernel's float32 butterflies in its order."""
    v = x.reshape(-1, q.QBLOCK)
    s = q.QBLOCK // 2
    while s >= 1:
        pairs = v.view(-1, q.QBLOCK // (2 * s), 2, s)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        v = torch.stack([a + b, a - b], dim=2).view(-1, q.QBLOCK)
        s //= 2
    return v.view_as(x)


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x's blocks of 32 rotated and rounded to symmetric int8 (scale max |x H| / 127), in float64."""
    blocks = _rotated(x).view(x.shape[0], x.shape[1] // q.QBLOCK, q.QBLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / max |x| divided as the kernel divides (torch's scalar / tensor multiplies by a reciprocal)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv)  # float32 products, rounded half to even as the kernel rounds
    return (codes.double() * (amax / 127.0).double()).view_as(x)


def test_hadamard_blocks_keep_the_products() -> None:
    """H is symmetric with H H = 32 I, so rotated blocks of x and W give x W^T (float64)."""
    h = q.hadamard()
    assert torch.equal(h, h.T) and torch.equal(h @ h, q.QBLOCK * torch.eye(q.QBLOCK))
    weight, x = torch.randn(24, 96, dtype=torch.float64), torch.randn(5, 96, dtype=torch.float64)
    rotated_x = (x.view(5, 3, q.QBLOCK) @ h.double()).view(5, 96)
    assert torch.allclose(rotated_x @ q.hadamard_blocks(weight).double().T, x @ weight.T, atol=1e-5)
    assert torch.allclose(_rotated(x.float()).double(), rotated_x, atol=1e-5)


def test_pack_layout_for_int8_products() -> None:
    """Four consecutive input features of a column sit side by side (one 32-bit lane); rows() rotates the blocks
    back, giving the weight within int8's rounding."""
    weight = torch.randn(cpu_kernels.LINEAR_PANEL + 5, 64)
    blocks = q.quantize_symmetric_int8(q.hadamard_blocks(weight))
    packed = q.pack(blocks, int8_products=True)
    assert packed.int8_products and packed.codes.shape == (2, 2, q.QBLOCK // q.INT8_GROUP, cpu_kernels.LINEAR_PANEL, 4)
    # column 19 = panel 1, lane 3; feature 45 = block 1, group 3, entry 1
    assert int(packed.codes[1, 1, 3, 3, 1]) == int(blocks.codes[19, 45])
    rows = packed.rows(torch.arange(weight.shape[0]))
    assert torch.allclose(rows, (blocks.dequantize().view(-1, 2, q.QBLOCK) @ q.hadamard()).view_as(weight), atol=1e-6)
    assert (rows - weight).abs().max() < 0.1
    assert packed.scales.shape == (2, 2, cpu_kernels.LINEAR_PANEL)  # d alone
    assert torch.equal(packed.scales, q.pack(blocks).scales[:, :, 0])


def test_symmetric_blocks() -> None:
    """Each block's d is max |w| / 127, its codes q + 128 with q in -127..127 (the largest weight's at +-127),
    m = -128 d, and every weight within d / 2 of its code's value; a block of zeros stays exact."""
    weight = torch.randn(7, 96) * torch.linspace(0.1, 3.0, 96)
    weight[2, 32:64] = 0.0
    blocks = q.quantize_symmetric_int8(weight)
    amax = weight.view(7, 3, q.QBLOCK).abs().amax(-1)
    assert torch.equal(blocks.d, amax / 127) and torch.equal(blocks.m, -128 * blocks.d)
    codes = blocks.codes.view(7, 3, q.QBLOCK).int() - 128
    assert codes.abs().max() == 127 and codes.min() >= -127
    assert ((blocks.dequantize() - weight).view(7, 3, q.QBLOCK).abs() <= blocks.d.unsqueeze(-1) / 2 + 1e-7).all()
    assert torch.equal(blocks.dequantize()[2, 32:64], torch.zeros(32))


def test_int8_products_take_symmetric_q8_blocks() -> None:
    """8-bit min/max blocks (an offset of their own) have no int8-products layout: a ValueError says what it
    takes."""
    with pytest.raises(ValueError, match="symmetric blocks"):
        q.pack(q.quantize_int8(torch.randn(4, 64)), int8_products=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 64, 250])  # tiles of 1..6 rows, split evenly
@pytest.mark.parametrize("shape", [(576, 200), (64, 13), (96, 48)])  # (in, out): a partial, one and whole pairs of panels
def test_kernel_matches_float64(path: str, rows: int, shape: tuple[int, int]) -> None:
    """x W^T + b equals float64's product of x's rotated blocks rounded to int8 and the dequantized (rotated)
    weight, with and without bias; a block of zeros in x is exact."""
    in_features, out_features = shape
    rng = np.random.default_rng(rows + in_features)
    weight = torch.from_numpy(rng.standard_normal((out_features, in_features)).astype(np.float32))
    blocks = q.quantize_symmetric_int8(q.hadamard_blocks(weight))
    packed = q.pack(blocks, int8_products=True)
    x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32)) * 4
    if rows:
        x[0, : q.QBLOCK] = 0.0
    bias = torch.from_numpy(rng.standard_normal(out_features).astype(np.float32))
    expected = _quantized_activations(x) @ blocks.dequantize().double().T
    with int8_path(path):
        y = cpu_kernels.linear_quantized(x, packed)
        with_bias = cpu_kernels.linear_quantized(x, packed, bias)
    assert torch.allclose(y.double(), expected, atol=1e-4, rtol=1e-5)
    assert torch.allclose(with_bias.double(), expected + bias.double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 6, 64])
def test_paths_give_the_same_bits(rows: int) -> None:
    """The int32 sums are exact and the float steps the same, so AVX512-VNNI and plain C agree to the bit."""
    blocks = q.quantize_symmetric_int8(torch.randn(200, 576))
    packed, x, bias = q.pack(blocks, int8_products=True), torch.randn(rows, 576), torch.randn(200)
    outputs = []
    for path in PATHS:
        with int8_path(path):
            outputs.append(cpu_kernels.linear_quantized(x, packed, bias))
    assert torch.equal(outputs[0], outputs[1])


def test_strided_input_reads_its_rows() -> None:
    """x given as a column slice of a wider tensor (a fused projection's output) reads only its own features."""
    blocks = q.quantize_symmetric_int8(torch.randn(48, 64))
    packed, wide = q.pack(blocks, int8_products=True), torch.randn(9, 160)
    x = wide[:, 32:96]
    assert torch.equal(cpu_kernels.linear_quantized(x, packed), cpu_kernels.linear_quantized(x.contiguous(), packed))


def test_rotation_keeps_an_outlier_block_precise() -> None:
    """A block holding one feature 100x the others: rounded as is, the others fall to a few int8 levels; rotated,
    the outlier spreads over the block and the product's error (exact weights) is several times smaller."""
    torch.manual_seed(0)
    weight, x = torch.randn(64, 64), torch.randn(16, 64)
    x[:, 5] = 100.0
    exact = x.double() @ weight.double().T
    rotated_error = (_quantized_activations(x) @ q.hadamard_blocks(weight).double().T - exact).norm()
    blocks = x.view(16, 2, q.QBLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    unrotated = (torch.round(blocks / scale) * scale).view_as(x)
    unrotated_error = (unrotated.double() @ weight.double().T - exact).norm()
    assert rotated_error < unrotated_error / 3
