"""int8 linear weights: blocks of 32 input features sharing a scale and an offset per output row.

A block's weights are ``w = d * q + m``, ``q`` in 0..255 (the ``q8`` kind). ``quantization="int8"`` quantizes
float weights into min/max blocks (``m`` the block's least weight, ``d`` its range / 255). Symmetric blocks
(``d * q``, ``q`` int8: ``quantize_symmetric_int8``'s, for int8 products) are stored as ``q + 128`` with
``m = -128 d``. (A GGUF file's blocks are served in their own layout: ``engine.layers.ggml_weight``.)

``QuantBlocks`` hold a weight row by row, as checkpoints store it; shards of a fused layer
are concatenated in that form. ``pack`` lays them out in the panels the C kernel reads
(``linear.c``, or ``linear_int8.c`` for int8 products); ``QuantizedWeight`` is the packed result
that a ``Linear`` serves.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from engine import cpu_kernels
from engine.cpu_kernels import LINEAR_PANEL

QBLOCK = 32  # input features per block (QBLOCK in linear.c)
INT8_GROUP = 4  # input features of a column side by side in the int8-products layout (one 32-bit lane)


class QuantBlocks(NamedTuple):
    """A ``[N, K]`` weight as blocks: uint8 ``codes`` ``[N, K]``, float32 scales ``d`` and
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
    """A packed quantized weight: uint8 ``codes`` ``[P, K / QBLOCK, QBLOCK, LINEAR_PANEL]``, and float32 ``scales`` ``[P, K / QBLOCK, 2, LINEAR_PANEL]``: d, then m.
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

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + b`` for float32 ``x [M, in_features]`` (``cpu_kernels.linear_quantized``)."""
        return cpu_kernels.linear_quantized(x, self, bias)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``W[index]`` ``[len(index), K]`` in float32 (an embedding lookup in a tied LM head)."""
        p, j = index // LINEAR_PANEL, index % LINEAR_PANEL
        blocks = self.in_features // QBLOCK
        if self.int8_products:  # rotated blocks: rotating once more gives W back (H H = QBLOCK I)
            q = self.codes[p, :, :, j, :].reshape(len(index), blocks, QBLOCK)
            w = (q.float() - 128.0) * self.scales[p, :, j].unsqueeze(-1)
            return (w @ hadamard()).reshape(len(index), blocks * QBLOCK)
        q = self.codes[p, :, :, j]  # [R, blocks, QBLOCK]
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


def pack(blocks: QuantBlocks, int8_products: bool = False) -> QuantizedWeight:
    """``blocks`` in the panel layout of the C kernel (``QuantizedWeight``; the int8-products one with
    ``int8_products``); rows past ``N`` are zero."""
    n, k = blocks.codes.shape
    if k % QBLOCK:
        raise ValueError(f"quantized weights need in_features divisible by {QBLOCK}; got {k}")
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
    d, m = (padded(t).view(panels, LINEAR_PANEL, nb).permute(0, 2, 1) for t in (blocks.d, blocks.m))
    scales = d.contiguous() if int8_products else torch.stack([d, m], dim=2).contiguous()
    return QuantizedWeight(blocks.kind, codes.contiguous(), scales, n, k, int8_products=int8_products)
