"""Quantized linear weights: blocks of 32 input features sharing a scale and an offset per output row.

A block's weights are ``w = d * q + m``. Two kinds of code serve every format the engine runs
natively, each exactly as its source defines it:

- ``q8``: ``q`` in 0..255. ``quantization="int8"`` quantizes float weights into min/max blocks
  (``m`` the block's least weight, ``d`` its range / 255). Symmetric blocks (``d * q``, ``q`` int8:
  GGUF's Q8_0, and ``quantize_symmetric_int8``'s for int8 products) are stored as ``q + 128`` with
  ``m = -128 d``.
- ``q4``: ``q`` in 0..15: GGUF's Q4_1, and Q4_0 (``d * (q - 8)``) with ``m = -8 d``.

``QuantBlocks`` hold a weight row by row, as checkpoints store it; shards of a fused layer
are concatenated in that form. ``pack`` lays them out in the panels the C kernel reads
(``linear.c``, or ``linear_int8.c`` for int8 products); ``QuantizedWeight`` is the packed result
that a ``Linear`` serves.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from engine.cpu_kernels import LINEAR_PANEL

QBLOCK = 32  # input features per block (QBLOCK in linear.c)
INT8_GROUP = 4  # input features of a column side by side in the int8-products layout (one 32-bit lane)
KINDS = ("q8", "q4")


class QuantBlocks(NamedTuple):
    """A ``[N, K]`` weight as blocks: uint8 ``codes`` ``[N, K]`` (0..15 for q4), float32 scales ``d`` and
    offsets ``m`` ``[N, K / QBLOCK]``."""

    kind: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]``."""
        n, k = self.codes.shape
        w = self.codes.float().view(n, k // QBLOCK, QBLOCK) * self.d.unsqueeze(-1) + self.m.unsqueeze(-1)
        return w.view(n, k)


class QuantizedWeight(NamedTuple):
    """A packed quantized weight: uint8 ``codes`` ``[P, K / QBLOCK, QBLOCK, LINEAR_PANEL]`` (q8) or
    ``[P, K / QBLOCK, QBLOCK, LINEAR_PANEL / 2]`` (q4, columns ``j`` and ``j + LINEAR_PANEL / 2`` in the low
    and high nibbles of byte ``j``), and float32 ``scales`` ``[P, K / QBLOCK, 2, LINEAR_PANEL]``: d, then m.
    With ``bf16_products``, the kernel multiplies x and the weights rounded to bfloat16 on AMX tiles where
    the CPU has them (from 16 rows; a bfloat16 model's quantized layers). With ``int8_products`` (symmetric q8
    blocks only), the kernel rotates x's blocks (``hadamard``), quantizes them to int8 and multiplies in int8
    (``linear_int8.c``): the blocks are then those of ``hadamard_blocks(W)``, ``codes``
    ``[P, K / QBLOCK, QBLOCK / INT8_GROUP, LINEAR_PANEL, INT8_GROUP]``, a column's consecutive features side by
    side, and ``scales`` ``[P, K / QBLOCK, LINEAR_PANEL]``: d alone (m is -128 d)."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    bf16_products: bool = False
    int8_products: bool = False

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``W[index]`` ``[len(index), K]`` in float32 (an embedding lookup in a tied LM head)."""
        p, j = index // LINEAR_PANEL, index % LINEAR_PANEL
        blocks = self.in_features // QBLOCK
        if self.int8_products:  # rotated blocks: rotating once more gives W back (H H = QBLOCK I)
            q = self.codes[p, :, :, j, :].reshape(len(index), blocks, QBLOCK)
            w = (q.float() - 128.0) * self.scales[p, :, j].unsqueeze(-1)
            return (w @ hadamard()).reshape(len(index), blocks * QBLOCK)
        if self.kind == "q8":
            q = self.codes[p, :, :, j]  # [R, blocks, QBLOCK]
        else:
            half = LINEAR_PANEL // 2
            byte = self.codes[p, :, :, j % half]
            q = torch.where((j < half).view(-1, 1, 1), byte & 15, byte >> 4)
        w = q.float() * self.scales[p, :, 0, j].unsqueeze(-1) + self.scales[p, :, 1, j].unsqueeze(-1)
        return w.reshape(len(index), blocks * QBLOCK)


@functools.cache
def hadamard() -> torch.Tensor:
    """The ``[QBLOCK, QBLOCK]`` Walsh-Hadamard matrix (Sylvester's, entries +-1): symmetric, ``H H = QBLOCK I``."""
    h = torch.ones(1, 1)
    while h.shape[0] < QBLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def hadamard_blocks(weight: torch.Tensor) -> torch.Tensor:
    """A float ``[N, K]`` weight with each block of ``QBLOCK`` input features rotated, ``W H / QBLOCK``: with x's
    blocks rotated as ``x H`` (the int8-products kernel does), the products are unchanged,
    ``(x H) (W H / QBLOCK)^T = x W^T``, and an outlier feature of x spreads over its block before x is rounded
    to int8."""
    n, k = weight.shape
    if k % QBLOCK:
        raise ValueError(f"int8 products need in_features divisible by {QBLOCK}; got {k}")
    rotated = weight.double().view(n, k // QBLOCK, QBLOCK) @ hadamard().double() / QBLOCK
    return rotated.float().view(n, k)


def concat(parts: list[QuantBlocks]) -> QuantBlocks:
    """Shards of one fused weight, stacked along the output rows; they must share a kind."""
    kinds = {part.kind for part in parts}
    if len(kinds) != 1:
        raise ValueError(f"shards of one weight must share a kind; got {sorted(kinds)}")
    return QuantBlocks(parts[0].kind, *(torch.cat([part[i] for part in parts]) for i in (1, 2, 3)))


def _float_blocks(weight: torch.Tensor) -> torch.Tensor:
    """A float ``[N, K]`` weight as float32 blocks ``[N, K / QBLOCK, QBLOCK]``.

    Raises:
        ValueError: ``K`` is not a multiple of ``QBLOCK``.
    """
    n, k = weight.shape
    if k % QBLOCK:
        raise ValueError(f"int8 quantization needs in_features divisible by {QBLOCK}; got {k}")
    return weight.float().view(n, k // QBLOCK, QBLOCK)


def quantize_int8(weight: torch.Tensor) -> QuantBlocks:
    """8-bit min/max blocks of a float ``[N, K]`` weight: per block ``m = min w``, ``d = (max w - m) / 255``,
    ``q = round((w - m) / d)``; every weight within ``d / 2`` of its code's value.

    (Against symmetric ``max|w| / 127`` blocks, a third of the log-probability error on the bundled model.)
    """
    n, k = weight.shape
    w = _float_blocks(weight)
    m = w.amin(-1)
    d = (w.amax(-1) - m) / 255.0
    q = torch.round((w - m.unsqueeze(-1)) / torch.where(d > 0, d, 1.0).unsqueeze(-1)).clamp(0, 255)
    return QuantBlocks("q8", q.to(torch.uint8).view(n, k), d, m)


def quantize_symmetric_int8(weight: torch.Tensor) -> QuantBlocks:
    """Symmetric 8-bit blocks of a float ``[N, K]`` weight: per block ``d = max |w| / 127``,
    ``q = round(w / d)`` in -127..127 (stored as ``q + 128``, ``m = -128 d``); every weight within ``d / 2``
    of its code's value.

    The int8-products kernel takes these: without an offset a block's share of an output is one float step
    where min/max blocks need two (6-8% faster linears). Their coarser steps cost little where the
    activations' rounding dominates (the bundled model with ``w8a8``, 32 prompts x 64 tokens teacher-forced, the
    products in float64: mean KL to float32 0.00121 against min/max blocks' 0.00106, float32's top token in
    98.1% of steps with either).
    """
    n, k = weight.shape
    w = _float_blocks(weight)
    d = w.abs().amax(-1) / 127.0
    q = torch.round(w / torch.where(d > 0, d, 1.0).unsqueeze(-1)).clamp(-127, 127)
    return QuantBlocks("q8", (q + 128).to(torch.uint8).view(n, k), d, -128.0 * d)


# GGUF block formats: type name -> bytes per block of QBLOCK weights
GGUF_BLOCK_BYTES = {"Q8_0": 2 + QBLOCK, "Q4_0": 2 + QBLOCK // 2, "Q4_1": 4 + QBLOCK // 2}


def from_gguf(type_name: str, raw: np.ndarray) -> QuantBlocks:
    """The blocks of a GGUF tensor in one of ``GGUF_BLOCK_BYTES``' formats, from its rows of raw bytes
    ``[N, K / QBLOCK * block bytes]`` (uint8). Scales are stored as float16 and widen exactly."""
    if type_name not in GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name} is not served natively; native: {', '.join(GGUF_BLOCK_BYTES)}")
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, GGUF_BLOCK_BYTES[type_name])
    d = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if type_name == "Q8_0":  # int8 q as q + 128: the same bits with the sign bit flipped
        codes = torch.from_numpy((blocks[:, :, 2:] ^ 0x80).reshape(n, -1))
        return QuantBlocks("q8", codes, d, -128.0 * d)
    packed = blocks[:, :, 4 if type_name == "Q4_1" else 2 :]  # byte i: weight i (low nibble), weight i + 16 (high)
    nibbles = np.concatenate([packed & 15, packed >> 4], axis=-1).reshape(n, -1)
    codes = torch.from_numpy(nibbles.astype(np.uint8))
    if type_name == "Q4_1":
        m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    else:
        m = -8.0 * d
    return QuantBlocks("q4", codes, d, m)


def pack(blocks: QuantBlocks, int8_products: bool = False) -> QuantizedWeight:
    """``blocks`` in the panel layout of the C kernel (``QuantizedWeight``; the int8-products one with
    ``int8_products``); rows past ``N`` are zero."""
    n, k = blocks.codes.shape
    if k % QBLOCK:
        raise ValueError(f"quantized weights need in_features divisible by {QBLOCK}; got {k}")
    if int8_products and blocks.kind != "q8":
        raise ValueError(f"int8 products take q8 blocks; got {blocks.kind}")
    if int8_products and not torch.equal(blocks.m, -128.0 * blocks.d):
        raise ValueError("int8 products take symmetric blocks (m = -128 d, as quantize_symmetric_int8 makes)")
    panels, nb = -(-n // LINEAR_PANEL), k // QBLOCK
    rows = panels * LINEAR_PANEL

    def padded(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
        out[:n] = t
        return out

    if int8_products:  # [rows, nb, QBLOCK] -> [P, nb, QBLOCK / INT8_GROUP, PANEL, INT8_GROUP]
        groups = QBLOCK // INT8_GROUP
        codes = padded(blocks.codes).view(panels, LINEAR_PANEL, nb, groups, INT8_GROUP).permute(0, 2, 3, 1, 4)
    else:  # [rows, nb, QBLOCK] -> [P, nb, QBLOCK, PANEL]
        codes = padded(blocks.codes).view(panels, LINEAR_PANEL, nb, QBLOCK).permute(0, 2, 3, 1)
    if blocks.kind == "q4":
        half = LINEAR_PANEL // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    d, m = (padded(t).view(panels, LINEAR_PANEL, nb).permute(0, 2, 1) for t in (blocks.d, blocks.m))
    scales = d.contiguous() if int8_products else torch.stack([d, m], dim=2).contiguous()
    return QuantizedWeight(blocks.kind, codes.contiguous(), scales, n, k, int8_products=int8_products)
