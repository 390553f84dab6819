"""GGML's tensor types as bytes: float32 rows quantized into GGML's block layouts, and back.

``quantize(weights, "Q4_K")`` returns the rows exactly as a GGUF file stores them (``block_q4_K``,
``block_q5_K`` and ``block_q6_K`` of ggml-common.h, ``QK_K = 256``, with their 6-bit packed scales
and mins); ``dequantize`` reads any of them back through gguf-py. The K-quant scales come from a
small least-squares search per sub-block (not llama.cpp's importance-weighted one); the error
bounds each type meets on Gaussian weights are in ``REL_RMS_ERROR_BOUND``. numpy only.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

QK_K = 256
TYPE_NAMES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# NOTE: every block type stores float16 scales (and F16 is float16), so larger values cannot be kept.
MAX_ABS_VALUE = 65504.0

# ||dequantize(quantize(x)) - x|| / ||x|| stays below these for Gaussian rows (tests/engine/model_files
# hold each type to its bound). F32 is exact.
REL_RMS_ERROR_BOUND = {
    "F32": 0.0,
    "F16": 5e-4,
    "BF16": 4e-3,
    "Q8_0": 0.01,
    "Q6_K": 0.02,
    "Q5_1": 0.04,
    "Q5_0": 0.045,
    "Q5_K": 0.04,
    "Q4_1": 0.08,
    "Q4_0": 0.09,
    "Q4_K": 0.08,
}

# Rows are quantized this many elements at a time, so temporaries stay a few MB whatever the tensor.
_CHUNK_ELEMENTS = 1 << 20
# Candidate scales tried per sub-block: the min/max scale times (levels + c) / levels for each c.
_SEARCH_STEPS = (-0.5, 0.0, 0.5, 1.0)


def ggml_type(type_name: str) -> GGMLQuantizationType:
    """The gguf-py enum member of ``type_name``.

    Raises:
        ValueError: not one of ``TYPE_NAMES``.
    """
    if type_name not in TYPE_NAMES:
        raise ValueError(f"type must be one of {', '.join(TYPE_NAMES)}; got {type_name!r}")
    return GGMLQuantizationType[type_name]


def block_shape(type_name: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of ``type_name``."""
    return GGML_QUANT_SIZES[ggml_type(type_name)]


def row_bytes(type_name: str, row_length: int) -> int:
    """Bytes one row of ``row_length`` elements takes in ``type_name``.

    Raises:
        ValueError: ``row_length`` is not a whole number of the type's blocks.
    """
    elements, nbytes = block_shape(type_name)
    if row_length % elements:
        what = "QK_K = 256" if type_name in K_QUANTS else f"its block of {elements}"
        raise ValueError(f"{type_name} needs rows whose length is a multiple of {what}; got rows of {row_length}")
    return row_length // elements * nbytes


def quantize(weights: np.ndarray, type_name: str) -> np.ndarray:
    """``weights`` (float32 ``[rows, K]``) in GGML type ``type_name``: uint8 ``[rows, row_bytes(type_name, K)]``.

    Raises:
        ValueError: an unknown type, weights that are not 2-D, K not a multiple of the type's block
            (256 for the K-quants), non-finite values, or magnitudes above ``MAX_ABS_VALUE`` for a type
            with float16 scales.
    """
    qtype = ggml_type(type_name)
    weights = np.asarray(weights, dtype=np.float32)
    if weights.ndim != 2:
        raise ValueError(f"weights must be 2-D [rows, K]; got shape {weights.shape}")
    rows, k = weights.shape
    out = np.empty((rows, row_bytes(type_name, k)), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for first in range(0, rows, step):
        chunk = weights[first : first + step]
        _check_values(chunk, type_name)
        out[first : first + step] = _quantize_rows(chunk, type_name, qtype)
    return out


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Rows stored in GGML type ``type_name`` (uint8 ``[rows, row bytes]``) as float32 ``[rows, K]`` (gguf-py)."""
    qtype = ggml_type(type_name)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if type_name == "F32":
        return raw.view(np.float32)
    return gguf_quants.dequantize(raw, qtype)


def _check_values(chunk: np.ndarray, type_name: str) -> None:
    if not np.isfinite(chunk).all():
        raise ValueError(f"cannot quantize to {type_name}: the weights hold {np.count_nonzero(~np.isfinite(chunk))} "
                         "non-finite values")
    if type_name not in ("F32", "BF16") and chunk.size and (peak := float(np.abs(chunk).max())) > MAX_ABS_VALUE:
        raise ValueError(f"cannot quantize to {type_name}: |value| {peak:g} exceeds {MAX_ABS_VALUE:g}, "
                         "the largest its float16 scales hold")


def _quantize_rows(rows: np.ndarray, type_name: str, qtype: GGMLQuantizationType) -> np.ndarray:
    if type_name == "F32":
        return np.ascontiguousarray(rows).view(np.uint8)
    if type_name == "F16":
        return rows.astype(np.float16).view(np.uint8)
    blocks = rows.reshape(-1, QK_K) if type_name in K_QUANTS else None
    if type_name == "Q4_K":
        packed = _pack_q4_k(*_quantize_k_blocks(blocks, levels=15))
    elif type_name == "Q5_K":
        packed = _pack_q5_k(*_quantize_k_blocks(blocks, levels=31))
    elif type_name == "Q6_K":
        packed = _quantize_q6_k(blocks)
    else:
        # NOTE: gguf-py's per-type quantize_rows on the whole chunk; its quantize() splits it into 16-row calls.
        return getattr(gguf_quants, qtype.name).quantize_rows(rows)
    return packed.reshape(rows.shape[0], -1)


# ---------------------------------------------------------------------------------- Q4_K and Q5_K
# A super-block of 256 = 8 sub-blocks of 32; x ~ d * sc[j] * q - dmin * m[j] with q in [0, levels],
# sc and m 6-bit, d and dmin float16.


def _fit_affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block (last axis) scale >= 0 and offset <= 0 with x ~ scale * q + offset, q in [0, levels].

    Each candidate rounding is refitted by least squares; the one of least squared error wins.
    """
    lo = np.minimum(x.min(axis=-1), 0.0)
    span = x.max(axis=-1) - lo
    safe_span = np.where(span > 0, span, 1.0)
    n = np.float32(x.shape[-1])
    sum_x = x.sum(axis=-1)
    sum_xx = np.einsum("...i,...i->...", x, x)
    best_scale, best_offset = span / levels, lo
    best_err = np.full(lo.shape, np.inf, dtype=np.float32)
    shifted = x - lo[..., None]
    for c in _SEARCH_STEPS:
        q = np.clip(np.rint(shifted * ((levels + c) / safe_span)[..., None]), 0, levels)
        sum_q = q.sum(axis=-1)
        sum_qq = np.einsum("...i,...i->...", q, q)
        sum_xq = np.einsum("...i,...i->...", x, q)
        det = n * sum_qq - sum_q * sum_q
        ok = det > 0
        safe_det = np.where(ok, det, 1.0)
        scale = np.where(ok, (n * sum_xq - sum_q * sum_x) / safe_det, best_scale)
        offset = np.where(ok, (sum_qq * sum_x - sum_q * sum_xq) / safe_det, best_offset)
        # NOTE: the format subtracts a non-negative min, so a positive offset is refitted as zero.
        positive = offset > 0
        scale = np.maximum(np.where(positive, sum_xq / np.where(sum_qq > 0, sum_qq, 1.0), scale), 0.0)
        offset = np.where(positive, 0.0, offset)
        # sum((scale * q + offset - x)^2), expanded so that no [.., 32] temporary is needed
        err = (sum_xx + scale * scale * sum_qq + n * offset * offset - 2 * scale * sum_xq - 2 * offset * sum_x
               + 2 * scale * offset * sum_q)
        better = err < best_err
        best_scale = np.where(better, scale, best_scale)
        best_offset = np.where(better, offset, best_offset)
        best_err = np.where(better, err, best_err)
    return best_scale.astype(np.float32), best_offset.astype(np.float32)


def _to_f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _six_bit(values: np.ndarray, step: np.ndarray) -> np.ndarray:
    """``values`` [nb, 8] >= 0 in units of ``step`` [nb], rounded into 0..63 (0 where the step is 0)."""
    inv = np.where(step > 0, 1.0 / np.where(step > 0, step, 1.0), 0.0)
    return np.clip(np.rint(values * inv[:, None]), 0, 63).astype(np.uint8)


def _quantize_k_blocks(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K codes of ``blocks`` [nb, 256]: (d, dmin float16 [nb], sc, m uint8 [nb, 8], q uint8 [nb, 256])."""
    nb = blocks.shape[0]
    x = blocks.reshape(nb, 8, 32)
    scale, offset = _fit_affine(x, levels)
    mins = -offset
    d = _to_f16(scale.max(axis=1) / 63)
    dmin = _to_f16(mins.max(axis=1) / 63)
    sc = _six_bit(scale, d.astype(np.float32))
    m = _six_bit(mins, dmin.astype(np.float32))
    step = d.astype(np.float32)[:, None] * sc          # [nb, 8] the effective scale of each sub-block
    low = dmin.astype(np.float32)[:, None] * m          # [nb, 8] the effective min of each sub-block
    inv = np.where(step > 0, 1.0 / np.where(step > 0, step, 1.0), 0.0)
    q = np.clip(np.rint((x + low[..., None]) * inv[..., None]), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q.reshape(nb, QK_K)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes that hold eight 6-bit scales and mins (ggml's get_scale_min_k4 layout)."""
    packed = np.empty((sc.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return packed


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[nb, 256] 4-bit values as 128 bytes: each 64-run's first 32 in the low nibbles, next 32 in the high."""
    runs = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(-1, 128)


def _pack_q4_k(d, dmin, sc, m, q) -> np.ndarray:
    return np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_scales(sc, m), _pack_nibbles(q)],
        axis=1,
    )


def _pack_q5_k(d, dmin, sc, m, q) -> np.ndarray:
    # qh[l] bit j holds the fifth bit of element 32 * j + l
    high = ((q >> 4) & 1).reshape(-1, 8, 32)
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_scales(sc, m), qh,
         _pack_nibbles(q)],
        axis=1,
    )


# ---------------------------------------------------------------------------------- Q6_K
# A super-block of 256 = 16 sub-blocks of 16; x ~ d * sc[j] * (q - 32), q in [0, 63], sc int8, d float16.


def _fit_symmetric(x: np.ndarray) -> np.ndarray:
    """Per sub-block (last axis) signed scale with x ~ scale * q, q in [-32, 31]; the largest |x| maps to -32."""
    peak_at = np.abs(x).argmax(axis=-1)[..., None]
    peak = np.take_along_axis(x, peak_at, axis=-1)[..., 0]
    safe_peak = np.where(peak != 0, peak, 1.0)
    sum_xx = np.einsum("...i,...i->...", x, x)
    best_scale = np.zeros(peak.shape, dtype=np.float32)
    best_err = np.full(peak.shape, np.inf, dtype=np.float32)
    for c in _SEARCH_STEPS:
        q = np.clip(np.rint(x * (-(32 + c) / safe_peak)[..., None]), -32, 31)
        sum_qq = np.einsum("...i,...i->...", q, q)
        sum_xq = np.einsum("...i,...i->...", x, q)
        scale = np.where(sum_qq > 0, sum_xq / np.where(sum_qq > 0, sum_qq, 1.0), 0.0)
        err = sum_xx - scale * sum_xq  # sum((scale * q - x)^2) at the least-squares scale
        better = err < best_err
        best_scale = np.where(better, scale, best_scale)
        best_err = np.where(better, err, best_err)
    return best_scale.astype(np.float32)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    x = blocks.reshape(nb, 16, 16)
    scale = _fit_symmetric(x)
    peak_at = np.abs(scale).argmax(axis=1)[:, None]
    peak = np.take_along_axis(scale, peak_at, axis=1)[:, 0]
    d = _to_f16(-peak / 128)
    d32 = d.astype(np.float32)
    inv_d = np.where(d32 != 0, 1.0 / np.where(d32 != 0, d32, 1.0), 0.0)
    sc = np.clip(np.rint(scale * inv_d[:, None]), -128, 127).astype(np.int8)
    step = d32[:, None] * sc                             # [nb, 16] the effective scale of each sub-block
    inv = np.where(step != 0, 1.0 / np.where(step != 0, step, 1.0), 0.0)
    q = (np.clip(np.rint(x * inv[..., None]), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)
    # each 128-half: ql[0:32] = q0 | q2 << 4, ql[32:64] = q1 | q3 << 4; qh = the four 2-bit tops
    low = q & 0x0F
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    top = q >> 4
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    return np.concatenate(
        [ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), d.view(np.uint8).reshape(nb, 2)], axis=1
    )
