"""Linear layers whose parameters know how to load checkpoint tensors (fused ones by shard)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} for a parameter of {tuple(param.shape)}")
    param.data.copy_(loaded)


# Up to this many rows, a float32 CPU matmul runs as (W x^T)^T: MKL computes the [out, rows]
# product 1.2-1.5x faster than x W^T at decode batch sizes (measured on AVX2 at SmolLM2's shapes),
# and the transposed view it returns costs nothing. Larger (prefill) batches gain nothing
# and their downstream ops prefer contiguous rows.
TRANSPOSED_MATMUL_MAX_ROWS = 128


class Linear(nn.Module):
    """``y = x W^T + b``; ``weight`` is [out, in], as in checkpoints.

    On CPU, in float32, a batch of at most ``TRANSPOSED_MATMUL_MAX_ROWS`` rows is computed as
    ``(W x^T)^T`` and returned as that transposed (non-contiguous) view; up to
    ``cpu_kernels.SKINNY_MAX_ROWS`` rows, by a C kernel that streams the weight
    (``cpu_kernels.skinny_linear``), in the same layout.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type == "cpu"
            and x.dtype == torch.float32
            and x.dim() == 2
            and x.shape[0] <= TRANSPOSED_MATMUL_MAX_ROWS
        ):
            if x.shape[0] <= cpu_kernels.SKINNY_MAX_ROWS and cpu_kernels.serves(x):
                return cpu_kernels.skinny_linear(x, self.weight, self.bias)
            if self.bias is None:
                return torch.mm(self.weight, x.t()).t()
            return torch.addmm(self.bias.unsqueeze(1), self.weight, x.t()).t()
        return F.linear(x, self.weight, self.bias)


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
