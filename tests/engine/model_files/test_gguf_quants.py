"""GGML block types: exact layouts (read back by gguf-py), stated error bounds, and the edge cases."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from engine.model_files.gguf_quants import (
    MAX_ABS_VALUE, REL_RMS_ERROR_BOUND, TYPE_NAMES, dequantize, quantize, row_bytes,
)  # fmt: skip

# Bytes per block as ggml-common.h declares the structs (block_q4_K = 2 + 2 + 12 + 128, ...).
BLOCK_BYTES = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}  # fmt: skip
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_block_sizes_are_ggmls() -> None:
    """Each type's block is the size ggml-common.h gives it, and a row is a whole number of them."""
    for name, (elements, nbytes) in BLOCK_BYTES.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == (elements, nbytes)
        assert row_bytes(name, 1024) == 1024 // elements * nbytes
        assert quantize(np.zeros((3, 1024), np.float32), name).shape == (3, 1024 // elements * nbytes)


@pytest.mark.parametrize("type_name", TYPE_NAMES)
@pytest.mark.parametrize("std", [1.0, 0.02])
def test_round_trip_within_the_stated_bound(type_name: str, std: float) -> None:
    """Gaussian rows (unit and weight-like scales) come back through gguf-py within the type's relative RMS
    bound, and not suspiciously better than a type of its bits can (a layout slip would be far off)."""
    x = (std * np.random.default_rng(0).standard_normal((48, 768))).astype(np.float32)
    err = _rel_rms(dequantize(quantize(x, type_name), type_name), x)
    assert err <= REL_RMS_ERROR_BOUND[type_name]
    if type_name in ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1"):
        assert err > REL_RMS_ERROR_BOUND[type_name] / 4


def test_k_quants_beat_their_32_block_peers() -> None:
    """Q4_K's and Q5_K's per-32 scales and mins are used: each is at least as good as Q4_1 / Q5_1."""
    x = np.random.default_rng(1).standard_normal((32, 1024)).astype(np.float32)
    errs = {t: _rel_rms(dequantize(quantize(x, t), t), x) for t in ("Q4_K", "Q4_1", "Q5_K", "Q5_1")}
    assert errs["Q4_K"] <= errs["Q4_1"] and errs["Q5_K"] <= errs["Q5_1"]


@pytest.mark.parametrize(("type_name", "low", "high"), [("Q4_K", 0, 15), ("Q5_K", 0, 31), ("Q6_K", -32, 31)])
def test_integer_grids_come_back_exactly(type_name: str, low: int, high: int) -> None:
    """Values on a K-quant's own grid (each sub-block spanning it) return to within float16 scale rounding:
    every nibble, fifth bit and 2-bit top lands where gguf-py reads it."""
    rng = np.random.default_rng(2)
    x = rng.integers(low, high + 1, size=(4, 512)).astype(np.float32)
    x[:, ::16] = low  # every sub-block holds both ends of the grid
    x[:, 1::16] = high
    got = dequantize(quantize(x, type_name), type_name)
    assert np.abs(got - x).max() <= 0.002 * max(abs(low), high)
    assert np.array_equal(np.rint(got), x)


def test_q4_k_scales_and_mins_pack_as_ggml_reads_them() -> None:
    """The 12 scale bytes of a Q4_K block decode (gguf-py's get_scale_min) to the 6-bit scales used."""
    x = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32) * np.linspace(0.1, 3, 8)[:, None]
    raw = quantize(x, "Q4_K")
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    sc, _ = Q4_K.get_scale_min(raw[:, 4:16].copy())
    scales = d[:, None] * sc.astype(np.float32)
    assert sc.max() == 63  # the largest scale of a block is its d times 63
    # the fitted range of each 32-value run: the scale times 15 is within one step of its span
    span = x.reshape(8, 8, 32).max(axis=2) - np.minimum(x.reshape(8, 8, 32).min(axis=2), 0)
    assert np.all(np.abs(scales * 15 - span) <= 2 * scales + 1e-6)


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_zero_rows_stay_zero(type_name: str) -> None:
    """All-zero rows quantize (no division by a zero scale) and read back as exact zeros."""
    got = dequantize(quantize(np.zeros((2, 512), np.float32), type_name), type_name)
    assert got.shape == (2, 512) and not np.any(got)


@pytest.mark.parametrize("type_name", TYPE_NAMES)
@pytest.mark.parametrize("value", [0.75, -3.0])
def test_a_constant_row_comes_back(type_name: str, value: float) -> None:
    """A constant row (one distinct value per block: no spread for a scale to fit) returns within float16 rounding."""
    x = np.full((2, 512), value, np.float32)
    got = dequantize(quantize(x, type_name), type_name)
    assert np.allclose(got, x, rtol=2e-3, atol=0)


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_large_magnitudes_within_float16_keep_their_bound(type_name: str) -> None:
    """Weights up to the float16 limit keep the type's error bound (no scale overflows)."""
    x = np.random.default_rng(4).uniform(-1, 1, (8, 512)).astype(np.float32) * 60000
    assert _rel_rms(dequantize(quantize(x, type_name), type_name), x) <= max(REL_RMS_ERROR_BOUND[type_name], 1e-6)


@pytest.mark.parametrize("type_name", [t for t in TYPE_NAMES if t not in ("F32", "BF16")])
def test_magnitudes_beyond_float16_are_refused(type_name: str) -> None:
    """A value no float16 scale can hold is a clear error naming the limit, not an inf in the file."""
    x = np.zeros((1, 256), np.float32)
    x[0, 7] = 2 * MAX_ABS_VALUE
    with pytest.raises(ValueError, match="65504"):
        quantize(x, type_name)


def test_float32_and_bfloat16_keep_any_finite_magnitude() -> None:
    """F32 is exact and BF16 within its rounding whatever the magnitude."""
    x = np.array([[1e30, -3e-30, 7.0, 0.0]], np.float32)
    assert np.array_equal(dequantize(quantize(x, "F32"), "F32"), x)
    assert np.allclose(dequantize(quantize(x, "BF16"), "BF16"), x, rtol=4e-3)


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_non_finite_values_are_refused(type_name: str) -> None:
    """NaN or inf in the weights is an error before anything is written."""
    x = np.ones((2, 256), np.float32)
    x[1, 3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, type_name)


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_k_quants_refuse_rows_not_a_multiple_of_256(type_name: str) -> None:
    """K-quant rows are whole 256-value super-blocks; 576 (SmolLM2-135M's width) is refused, naming QK_K."""
    with pytest.raises(ValueError, match=rf"{type_name} needs rows whose length is a multiple of QK_K = 256; got.* 576"):
        quantize(np.ones((2, 576), np.float32), type_name)


def test_32_block_types_refuse_rows_not_a_multiple_of_32() -> None:
    """Q8_0 and friends take rows of whole 32-value blocks."""
    with pytest.raises(ValueError, match="multiple of its block of 32"):
        quantize(np.ones((2, 48), np.float32), "Q8_0")


def test_bad_arguments_are_refused() -> None:
    """An unknown type name and a 1-D array are errors naming what was expected."""
    with pytest.raises(ValueError, match="type must be one of"):
        quantize(np.ones((1, 256), np.float32), "Q3_K")
    with pytest.raises(ValueError, match=r"2-D \[rows, K\]"):
        quantize(np.ones(256, np.float32), "Q8_0")


def test_quantize_is_row_independent() -> None:
    """Rows quantize alone: a tensor equals its rows quantized one at a time (chunking cannot change bytes)."""
    x = np.random.default_rng(5).standard_normal((5, 512)).astype(np.float32)
    for type_name in K_QUANTS + ("Q8_0",):
        whole = quantize(x, type_name)
        assert np.array_equal(whole, np.concatenate([quantize(x[i : i + 1], type_name) for i in range(5)]))
