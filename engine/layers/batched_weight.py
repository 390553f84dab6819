"""A GGUF weight held in two layouts, each multiplying the steps it is fastest at.

The file's blocks (``GGMLWeight``) read the fewest bytes, which is what one row's decode costs; at batch their
kernels unpack every block once per tile of a few rows and fall behind the dense kernels, which read each
weight once for all of a step's rows (``linear_int8.c``'s int8 products on AVX512-VNNI, the bfloat16 panels of
``linear_bf16.c``). A ``BatchedWeight`` keeps both: a step of fewer than ``min_rows`` rows multiplies the
blocks, a larger one the dense layout made from them at load (``engine.worker.batched_layout``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine import cpu_kernels
from engine.layers.ggml_weight import GGMLWeight
from engine.layers.quantization import QuantizedWeight

# From how many rows a step multiplies the dense layout. Measured on the bundled model (Q4_1 blocks on AVX2,
# int8 products on AVX512-VNNI, an AMD EPYC Zen 5 of 2 cores): the 120 linears of its 30 layers took 0.87x the
# dense layout's time at 1 row, 1.1-1.3x at 3 and 4, 5x at 16 and 10x at 64 rows (each the best of 20 runs).
BATCHED_MIN_ROWS = 4


class PackedWeight(NamedTuple):
    """A ``[out_features, in_features]`` weight in the float panels ``cpu_kernels.linear`` reads
    (``pack_linear_weight``: float32 or bfloat16)."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    @property
    def kind(self) -> str:
        return str(self.packed.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + b`` for float32 ``x [M, in_features]``."""
        return cpu_kernels.linear(x, self.packed, self.out_features, bias)


class BatchedWeight:
    """``blocks`` for steps of fewer than ``min_rows`` rows, ``dense`` (the same weight) from ``min_rows``.

    Raises:
        ValueError: ``dense`` of another shape than ``blocks``, or ``min_rows`` below 1.
    """

    def __init__(self, blocks: GGMLWeight, dense: QuantizedWeight | PackedWeight, min_rows: int) -> None:
        if (dense.out_features, dense.in_features) != (blocks.out_features, blocks.in_features):
            raise ValueError(
                f"a dense layout of [{dense.out_features}, {dense.in_features}] for blocks of "
                f"[{blocks.out_features}, {blocks.in_features}]"
            )
        if min_rows < 1:
            raise ValueError(f"min_rows must be at least 1; got {min_rows}")
        self.blocks, self.dense, self.min_rows = blocks, dense, min_rows
        self.out_features, self.in_features = blocks.out_features, blocks.in_features

    @property
    def kind(self) -> str:
        """The blocks' types (``GGMLWeight.kind``): what a step of one row reads."""
        return self.blocks.kind

    @property
    def nbytes(self) -> int:
        """The blocks' bytes; the dense layout's are ``dense.nbytes``."""
        return self.blocks.nbytes

    def serving(self, rows: int) -> GGMLWeight | QuantizedWeight | PackedWeight:
        """The layout that multiplies a step of ``rows`` rows."""
        return self.dense if rows >= self.min_rows else self.blocks

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + b`` for float32 ``x [M, in_features]``, in the layout that serves ``M`` rows."""
        return self.serving(x.shape[0]).matmul(x, bias)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``W[index]`` in float32 from the blocks (an embedding lookup)."""
        return self.blocks.rows(index)
