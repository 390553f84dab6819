"""Linear weights in GGUF's own types (ggml's blocks), as the file stores them.

A ``GGMLWeight`` is a ``[N, K]`` weight as one or more parts of consecutive output rows, each of one ggml type
(a fused projection whose shards differ: a Q4_K_M file's query rows in Q4_K and value rows in Q6_K). The CPU
kernel multiplies the blocks in place (``cpu_kernels.linear_ggml``, ``linear_ggml.c``): x is quantized to int8
blocks as llama.cpp does and the products are integer sums, so a layer reads its weights' bytes and nothing
more. ``GGML_NATIVE`` lists the types served so; a model's tensors of other types are dequantized at load.
On the AVX512-VNNI path, Q4_0, Q8_0, Q4_K and Q6_K parts are repacked once, here, into groups of 16 rows in the same
bytes (``cpu_kernels.ggml_repacked``), which that path multiplies 16 columns at a time.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine import cpu_kernels
from engine.layers.quantization import QuantizedWeight
from engine.model_files.gguf import GGML_TYPES, TYPE_IDS

GGML_NATIVE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


class GGMLPart(NamedTuple):
    """``rows`` consecutive output rows of one ggml type: ``data`` uint8 ``[rows, row bytes]`` (as the file stores
    them; a ``GGMLWeight``'s own parts hold them in the kernels' layout)."""

    type_name: str
    data: torch.Tensor


class GGMLWeight:
    """A ``[out_features, in_features]`` weight as ``parts`` (their rows one after another).

    Raises:
        ValueError: a type not in ``GGML_NATIVE``, or a part whose bytes do not hold its rows of ``in_features``.
    """

    def __init__(self, parts: list[GGMLPart], in_features: int) -> None:
        for part in parts:
            if part.type_name not in GGML_NATIVE:
                raise ValueError(f"ggml type {part.type_name} is not served natively; native: {', '.join(GGML_NATIVE)}")
            _, block, block_bytes = GGML_TYPES[TYPE_IDS[part.type_name]]
            if in_features % block:
                raise ValueError(f"{part.type_name} blocks hold {block} features; {in_features} is not a multiple")
            expected = in_features // block * block_bytes
            if part.data.dtype != torch.uint8 or part.data.dim() != 2 or part.data.shape[1] != expected \
                    or not part.data.is_contiguous():
                raise ValueError(
                    f"a {part.type_name} part of {in_features} features needs contiguous uint8 rows of {expected} "
                    f"bytes; got {part.data.dtype} {list(part.data.shape)}"
                )
        laid_out = [cpu_kernels.ggml_repacked(TYPE_IDS[p.type_name], p.data, in_features) for p in parts]
        self.parts = tuple(GGMLPart(p.type_name, data) for p, (_, data) in zip(parts, laid_out))
        self._type_ids = [type_id for type_id, _ in laid_out]  # the kernels' ids: an x16 one for a repacked part
        self.in_features = in_features
        self.out_features = sum(part.data.shape[0] for part in parts)
        self.c_parts = cpu_kernels.ggml_parts(laid_out)

    @classmethod
    def from_numpy(cls, parts: list[tuple[str, np.ndarray]], in_features: int) -> GGMLWeight:
        """A weight from rows of raw bytes (``uint8 [rows, row bytes]`` per part, e.g. a ``GGUFCheckpoint``'s)."""
        return cls([GGMLPart(name, torch.from_numpy(np.ascontiguousarray(rows))) for name, rows in parts], in_features)

    @property
    def kind(self) -> str:
        """The parts' types: ``Q4_K``, or ``Q4_K+Q6_K`` for a fused weight of two."""
        return "+".join(dict.fromkeys(part.type_name for part in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(part.data.nbytes for part in self.parts)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + b`` for float32 ``x [M, in_features]``."""
        return cpu_kernels.linear_ggml(x, self, bias)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``W[index]`` in float32 (an embedding lookup).

        Raises:
            IndexError: an index outside ``[0, out_features)``.
        """
        if len(index) and not 0 <= int(index.min()) <= int(index.max()) < self.out_features:
            raise IndexError(f"a row index outside [0, {self.out_features})")
        out = torch.empty(len(index), self.in_features)
        first = 0
        for part, type_id in zip(self.parts, self._type_ids):
            rows = part.data.shape[0]
            inside = (index >= first) & (index < first + rows)
            if bool(inside.any()):
                out[inside] = cpu_kernels.ggml_rows(type_id, part.data, index[inside] - first, self.in_features)
            first += rows
        return out

    def int8_panels(self) -> QuantizedWeight:
        """This weight as ``quantization="w8a8"``'s int8-products panels of its dequantized rows: what
        ``pack(quantize_symmetric_int8(hadamard_blocks(self.dequantize())), int8_products=True)`` makes, converted
        in C (``cpu_kernels.ggml_int8_panels``) without the float32 weight.

        Raises:
            ValueError: ``in_features`` is not a multiple of 32.
        """
        parts = [(type_id, part.data) for type_id, part in zip(self._type_ids, self.parts)]
        codes, scales = cpu_kernels.ggml_int8_panels(parts, self.in_features)
        return QuantizedWeight("q8", codes, scales, self.out_features, self.in_features, int8_products=True)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out_features, in_features]``."""
        return self.rows(torch.arange(self.out_features))
