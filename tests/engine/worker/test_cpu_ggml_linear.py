"""Weights in GGUF's own types (``GGMLWeight``, ``linear_ggml.c``): every native type's matmul, on every path
this CPU has, against float64 products of gguf-py's dequantization of the same bytes.

The kernel quantizes each row of x to int8 blocks (32 for the legacy types, 256 for the K-quants, ``d = max |x| /
127``, rounded to nearest even) and sums integer products, as llama.cpp does. Two references:

- the same int8 x times gguf-py's float64 weights: the kernel's only other error is float32 rounding (measured
  below 3e-7 of the largest output; bound 1e-5);
- the float x times them: the activations' rounding (measured 0.3-1.3% of the largest output with random
  weights; bound 3%; the float types 1e-5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from engine import cpu_kernels
from engine.layers.ggml_weight import GGML_NATIVE, GGMLPart, GGMLWeight
from engine.model_files.gguf import TYPE_IDS

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernels")

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
FLOATS = ("F32", "F16", "BF16")


@pytest.fixture(params=cpu_kernels.GGML_LINEAR_PATHS)
def path(request: pytest.FixtureRequest):
    """Each path the kernel can take here (AVX2 where the CPU has it), capped in turn."""
    lib = cpu_kernels.library()
    wanted = cpu_kernels.GGML_LINEAR_PATHS.index(request.param)
    lib.ggml_linear_limit(wanted)
    if cpu_kernels.ggml_linear_path() != request.param:
        lib.ggml_linear_limit(len(cpu_kernels.GGML_LINEAR_PATHS) - 1)
        pytest.skip(f"this CPU has no {request.param} path")
    yield request.param
    lib.ggml_linear_limit(len(cpu_kernels.GGML_LINEAR_PATHS) - 1)


def random_rows(type_name: str, rows: int, features: int, seed: int = 0) -> np.ndarray:
    """``rows`` rows of a valid tensor of ``type_name``: random codes and scale bytes, float16 scales of sizes
    that keep the weights near 0.01 (as a model's are)."""
    rng = np.random.default_rng(seed)
    kind = GGMLQuantizationType[type_name]
    if type_name in FLOATS:
        values = (rng.standard_normal((rows, features)) * 0.05).astype(np.float32)
        if type_name == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.astype(np.float16 if type_name == "F16" else np.float32).view(np.uint8)
    block, block_bytes = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, features // block, block_bytes), dtype=np.uint8)

    def f16(low: float, high: float) -> np.ndarray:
        return rng.uniform(low, high, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)

    if type_name in ("Q8_0", "Q4_0", "Q5_0"):
        raw[..., 0:2] = f16(1e-3, 2e-2)
    elif type_name in ("Q4_1", "Q5_1"):
        raw[..., 0:2], raw[..., 2:4] = f16(1e-3, 2e-2), f16(-0.1, 0.1)
    elif type_name in ("Q4_K", "Q5_K"):
        raw[..., 0:2], raw[..., 2:4] = f16(1e-4, 1e-3), f16(1e-4, 2e-3)
    else:  # Q6_K: d last
        raw[..., -2:] = f16(1e-4, 1e-3)
    return raw.reshape(rows, -1)


def dequantized(type_name: str, raw: np.ndarray, features: int) -> np.ndarray:
    """gguf-py's float weights of ``raw``, in float64."""
    values = quants.dequantize(raw, GGMLQuantizationType[type_name])
    return np.asarray(values, dtype=np.float64).reshape(raw.shape[0], features)


def int8_activations(x: np.ndarray, type_name: str) -> np.ndarray:
    """x as the kernel quantizes it, in float64: blocks of 32 (256 for the K-quants), d = max |x| / 127, codes
    round(x / d) to nearest even, all in float32 as the kernel computes them."""
    if type_name in FLOATS:
        return x.astype(np.float64)
    block = 256 if type_name in K_QUANTS else 32
    blocks = x.reshape(x.shape[0], -1, block)
    d = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127.0)).astype(np.float32)
    inverse = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    return (np.rint(blocks * inverse).astype(np.float64) * d).reshape(x.shape)


def weight_of(type_name: str, raw: np.ndarray, features: int) -> GGMLWeight:
    return GGMLWeight.from_numpy([(type_name, raw)], features)


def _largest(reference: np.ndarray) -> float:
    return float(np.abs(reference).max())


@pytest.mark.parametrize("type_name", GGML_NATIVE)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("out", [37, 48])
def test_matmul_equals_float64_of_the_dequantized_weight(path: str, type_name: str, rows: int, out: int) -> None:
    """Batch 1 and batched (tiles of 1-4 rows of x), a bias; 48 output columns (on AVX512-VNNI, Q4_0, Q8_0, Q4_K and Q6_K
    repacked in groups of 16) or 37 (groups of 16 and a remainder, the file's layout)."""
    features = 512
    raw = random_rows(type_name, out, features)
    reference_w = dequantized(type_name, raw, features)
    x = np.random.default_rng(5).standard_normal((rows, features)).astype(np.float32)
    bias = np.random.default_rng(6).standard_normal(out).astype(np.float32)
    y = weight_of(type_name, raw, features).matmul(torch.from_numpy(x), torch.from_numpy(bias)).numpy()
    same_x = int8_activations(x, type_name) @ reference_w.T + bias
    float_x = x.astype(np.float64) @ reference_w.T + bias
    assert np.abs(y - same_x).max() <= 1e-5 * _largest(same_x)
    bound = 1e-5 if type_name in FLOATS else 3e-2
    assert np.abs(y - float_x).max() <= bound * _largest(float_x)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16"])
def test_legacy_types_take_any_multiple_of_32_features(path: str, type_name: str) -> None:
    features = 96
    raw = random_rows(type_name, 5, features, seed=2)
    x = np.random.default_rng(3).standard_normal((2, features)).astype(np.float32)
    y = weight_of(type_name, raw, features).matmul(torch.from_numpy(x), None).numpy()
    expected = int8_activations(x, type_name) @ dequantized(type_name, raw, features).T
    assert np.abs(y - expected).max() <= 1e-5 * _largest(expected)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0", "BF16"])
@pytest.mark.parametrize("out", [21, 32])
def test_a_row_of_x_gives_the_same_bits_alone_and_batched(path: str, type_name: str, out: int) -> None:
    """x's rows are quantized one by one and every output computed by the same steps, so a request's results do
    not depend on the rows it is batched with (32 columns: two groups of 16 on AVX512-VNNI)."""
    features = 768
    weight = weight_of(type_name, random_rows(type_name, out, features, seed=4), features)
    x = torch.from_numpy(np.random.default_rng(7).standard_normal((11, features)).astype(np.float32))
    batched = weight.matmul(x, None)
    for r in range(len(x)):
        assert torch.equal(weight.matmul(x[r : r + 1], None)[0], batched[r])
    assert torch.equal(weight.matmul(x[3:7], None), batched[3:7])


def test_the_paths_agree(path: str) -> None:
    """Each vector path and plain C give the same outputs up to float32's summation order; a weight laid out for
    one path (repacked in groups of 16 on AVX512-VNNI) gives every path's own outputs, bit for bit."""
    if path == "generic":
        pytest.skip("the reference path")
    lib = cpu_kernels.library()
    x = torch.from_numpy(np.random.default_rng(8).standard_normal((5, 512)).astype(np.float32))
    top = cpu_kernels.GGML_LINEAR_PATHS.index(path)
    for type_name in GGML_NATIVE:
        raw = random_rows(type_name, 32, 512, seed=9)
        weight = weight_of(type_name, raw, 512)
        repacked = path == "avx512-vnni" and type_name in ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
        assert weight.c_parts[0].type == TYPE_IDS[type_name] + (1000 if repacked else 0)
        fast = weight.matmul(x, None)
        outputs = {}
        try:
            for lower in range(top):
                lib.ggml_linear_limit(lower)
                outputs[lower] = (weight.matmul(x, None), weight_of(type_name, raw, 512).matmul(x, None))
        finally:
            lib.ggml_linear_limit(top)
        plain = outputs[0][1]
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5 * float(plain.abs().max()), msg=type_name)
        for lower, (laid_out_here, own) in outputs.items():
            assert torch.equal(laid_out_here, own), (type_name, lower)


def test_parts_of_different_types_are_one_weight(path: str) -> None:
    """A fused weight whose shards differ in type (Q4_K rows, then Q6_K, then Q8_0) equals its parts side by
    side, and looks up rows across the parts."""
    features = 256
    shards = [("Q4_K", 32), ("Q6_K", 16), ("Q4_0", 16), ("Q8_0", 3)]
    raws = [random_rows(name, rows, features, seed=i) for i, (name, rows) in enumerate(shards)]
    weight = GGMLWeight.from_numpy([(name, raw) for (name, _), raw in zip(shards, raws)], features)
    assert (weight.out_features, weight.kind) == (67, "Q4_K+Q6_K+Q4_0+Q8_0")
    x = torch.from_numpy(np.random.default_rng(10).standard_normal((3, features)).astype(np.float32))
    fused = weight.matmul(x, None)
    alone = torch.cat([weight_of(name, raw, features).matmul(x, None) for (name, _), raw in zip(shards, raws)], 1)
    assert torch.equal(fused, alone)
    index = torch.tensor([0, 66, 12, 40, 21, 5, 63, 50])
    full = np.concatenate([dequantized(name, raw, features) for (name, _), raw in zip(shards, raws)])
    assert np.array_equal(weight.rows(index).numpy(), full[index.numpy()].astype(np.float32))


def test_a_repacked_part_off_a_group_boundary_is_served(path: str) -> None:
    """A part whose rows do not start on a group of 16 columns (after 3 Q8_0 rows) runs a row at a time, within
    the float64 reference's bound."""
    features = 256
    shards = [("Q8_0", 3), ("Q4_0", 16), ("Q6_K", 32)]
    raws = [random_rows(name, rows, features, seed=12 + i) for i, (name, rows) in enumerate(shards)]
    weight = GGMLWeight.from_numpy([(name, raw) for (name, _), raw in zip(shards, raws)], features)
    x = np.random.default_rng(13).standard_normal((2, features)).astype(np.float32)
    y = weight.matmul(torch.from_numpy(x), None).numpy()
    expected = np.concatenate([int8_activations(x, name) @ dequantized(name, raw, features).T
                               for (name, _), raw in zip(shards, raws)], 1)  # fmt: skip
    assert np.abs(y - expected).max() <= 1e-5 * _largest(expected)


@pytest.mark.parametrize("rows", [4, 7, 13, 64])
def test_pairs_of_groups_give_the_group_tiles_bits(path: str, rows: int) -> None:
    """From 4 rows of x, AVX512-VNNI multiplies Q4_K and Q6_K groups in pairs whose scales (and Q6_K's codes) it
    unpacks once a call, and Q8_0 groups in pairs as they are (``ggml_unpacked.h``): the same bits as the one-group
    tiles, for pairs, a lone group, parts off a group boundary and a bias."""
    if path != "avx512-vnni":
        pytest.skip("the unpacked pairs are an AVX512-VNNI path")
    features = 512
    shards = [("Q4_K", 64), ("Q6_K", 48), ("Q8_0", 48), ("Q4_0", 32), ("Q5_K", 48), ("Q8_0", 3), ("Q4_K", 16), ("Q6_K", 32)]
    raws = [random_rows(name, n, features, seed=20 + i) for i, (name, n) in enumerate(shards)]
    weight = GGMLWeight.from_numpy([(name, raw) for (name, _), raw in zip(shards, raws)], features)
    x = torch.from_numpy(np.random.default_rng(21).standard_normal((rows, features)).astype(np.float32))
    bias = torch.from_numpy(np.random.default_rng(22).standard_normal(weight.out_features).astype(np.float32))
    lib = cpu_kernels.library()
    pairs = weight.matmul(x, bias)
    try:
        lib.ggml_unpacked_rows(1 << 40)
        groups = weight.matmul(x, bias)
    finally:
        lib.ggml_unpacked_rows(4)
    assert torch.equal(pairs, groups)
    assert torch.equal(pairs[-1:], weight.matmul(x[-1:], bias))


@pytest.mark.parametrize("type_name", GGML_NATIVE)
def test_rows_dequantize_as_gguf_py(path: str, type_name: str) -> None:
    """An embedding lookup gives gguf-py's float32 weights exactly, in any order, repeats included (of a weight
    repacked in groups of 16 too)."""
    raw = random_rows(type_name, 32, 256, seed=11)
    index = torch.tensor([9, 0, 3, 3, 7, 31, 16, 17])
    expected = dequantized(type_name, raw, 256)[index.numpy()].astype(np.float32)
    assert np.array_equal(weight_of(type_name, raw, 256).rows(index).numpy(), expected)


def test_bad_parts_are_refused() -> None:
    """A type the kernels do not serve, or bytes that do not hold whole rows of blocks, is a ValueError that says
    what was expected."""
    with pytest.raises(ValueError, match="Q2_K is not served natively"):
        GGMLWeight([GGMLPart("Q2_K", torch.zeros(4, 84, dtype=torch.uint8))], 256)
    with pytest.raises(ValueError, match="rows of 144 bytes"):
        GGMLWeight([GGMLPart("Q4_K", torch.zeros(4, 100, dtype=torch.uint8))], 256)
    with pytest.raises(ValueError, match="Q4_K blocks hold 256 features; 96"):
        GGMLWeight([GGMLPart("Q4_K", torch.zeros(4, 54, dtype=torch.uint8))], 96)
    weight = weight_of("Q8_0", random_rows("Q8_0", 4, 64), 64)
    with pytest.raises(ValueError, match="in_features"):
        weight.matmul(torch.zeros(2, 32), None)
    with pytest.raises(IndexError, match="outside"):
        weight.rows(torch.tensor([4]))
