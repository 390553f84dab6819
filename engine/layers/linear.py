"""Linear layers whose parameters know how to load checkpoint tensors (fused ones by shard)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.layers.batched_weight import BatchedWeight
from engine.layers.ggml_weight import GGMLWeight
from engine.layers.quantization import QuantizedWeight


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} for a parameter of {tuple(param.shape)}")
    param.data.copy_(loaded)


class CheckpointSlice(NamedTuple):
    """The part of a checkpoint tensor a layer holds: ``size`` indices from ``start`` along ``dim`` (a tensor
    with no such dimension, a row-split layer's bias, is held whole)."""

    dim: int
    start: int
    size: int


class Linear(nn.Module):
    """``y = x W^T + b``; ``weight`` is [out, in], as in checkpoints.

    After loading, ``pack()`` moves the weight into the panel layout of the C kernel
    (``cpu_kernels.linear``), which computes every batch size on CPU for float32 input, the
    weight in float32 or bfloat16 (widened exactly); ``weight`` is then None and ``packed``
    holds it. ``quantize(q)`` serves quantized blocks instead: int8 panels (``QuantizedWeight``), a GGUF
    file's own blocks (``GGMLWeight``), or those and a dense layout for large steps (``BatchedWeight``), each
    multiplying through its ``matmul``.
    Unpacked (on GPU, or without the CPU kernels), it is ``F.linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("packed", None)
        self.quantized: QuantizedWeight | GGMLWeight | BatchedWeight | None = None

    def pack(self) -> None:
        """Replace ``weight`` by its packed panels (``cpu_kernels.pack_linear_weight``)."""
        self.packed = cpu_kernels.pack_linear_weight(self.weight.data)
        self.weight = None

    def quantize(self, weight: QuantizedWeight | GGMLWeight | BatchedWeight) -> None:
        """Serve ``weight`` (this layer's weight as quantized blocks) instead of the float weight."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"a quantized weight of [{weight.out_features}, {weight.in_features}] for a layer of "
                f"[{self.out_features}, {self.in_features}]"
            )
        self.quantized, self.weight, self.packed = weight, None, None

    def checkpoint_slice(self, shard: str | None) -> CheckpointSlice | None:
        """The part of the checkpoint tensor of ``shard`` (None: the layer's only one) this layer holds; None:
        all of it (a tensor-parallel layer holds its rank's part)."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` in whichever form the weight is held."""
        if self.quantized is not None:
            return self.quantized.matmul(x, bias)
        if self.packed is not None:
            return cpu_kernels.linear(x, self.packed, self.out_features, bias)
        return F.linear(x, self.weight, bias)


class VocabEmbedding(Linear):
    """Token embeddings: ``forward(ids)`` gives rows ``[len(ids), hidden]`` of a ``[vocab, hidden]`` weight,
    in the weight's dtype, from either layout. It is a ``Linear`` so that a tied LM head is this very
    module, its weight packed once; the head's logits are ``Linear.forward(module, hidden)``."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(hidden_size, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.rows(input_ids)
        if self.packed is not None:
            return cpu_kernels.packed_rows(self.packed, input_ids, self.in_features)
        return F.embedding(input_ids, self.weight)


class MergedLinear(Linear):
    """Several projections of one input fused into one matmul; output shards sit side by side.

    A checkpoint stores each shard as its own tensor; ``weight_loader(param, loaded, shard)``
    copies one of them into its rows of ``weight`` or ``bias``.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        offset, size = self.shard_offsets[shard]
        default_weight_loader(param.data.narrow(0, offset, size), loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split([size for _, size in self.shard_offsets.values()], dim=-1)
