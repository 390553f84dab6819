"""Linear layers whose parameters know how to load checkpoint tensors (fused ones by shard)."""

from __future__ import annotations

import threading

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
# A weight stored narrower than its input (bfloat16 for float32 activations) widens this many
# elements at a time into a per-thread scratch of 4 MB, which stays in cache for the chunk's matmul.
WIDEN_CHUNK_ELEMENTS = 1 << 20
_widen_scratch = threading.local()


class Linear(nn.Module):
    """``y = x W^T + b``; ``weight`` is [out, in], as in checkpoints.

    On CPU, for float32 input, a batch of at most ``TRANSPOSED_MATMUL_MAX_ROWS`` rows is computed
    as ``(W x^T)^T`` and returned as that transposed (non-contiguous) view; up to
    ``cpu_kernels.SKINNY_MAX_ROWS`` rows, by a C kernel that streams the weight
    (``cpu_kernels.skinny_linear``), in the same layout. The weight may be stored in bfloat16
    (see ``ModelRunner``): it then widens exactly to float32, in the kernel or chunk by chunk.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
            if x.shape[0] <= cpu_kernels.SKINNY_MAX_ROWS and cpu_kernels.serves(x):
                return cpu_kernels.skinny_linear(x, self.weight, self.bias)
            if self.weight.dtype != torch.float32:
                return widened_linear(x, self.weight, self.bias)
            if x.shape[0] <= TRANSPOSED_MATMUL_MAX_ROWS:
                if self.bias is None:
                    return torch.mm(self.weight, x.t()).t()
                return torch.addmm(self.bias.unsqueeze(1), self.weight, x.t()).t()
        return F.linear(x, self.weight, self.bias)


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for a weight ``[N, K]`` stored narrower than ``x [M, K]``: the weight widens to ``x``'s
    dtype ``WIDEN_CHUNK_ELEMENTS`` at a time into a reused scratch, and each chunk's product fills its output
    columns. Up to ``TRANSPOSED_MATMUL_MAX_ROWS`` rows the result is the transposed view, as ``Linear``'s.
    Inference only: no gradient flows through the widened copies."""
    weight = weight.detach()
    rows = x.shape[0]
    out_features, in_features = weight.shape
    transposed = rows <= TRANSPOSED_MATMUL_MAX_ROWS
    out = torch.empty((out_features, rows) if transposed else (rows, out_features), dtype=x.dtype)
    chunk = max(1, WIDEN_CHUNK_ELEMENTS // in_features)
    scratch = getattr(_widen_scratch, "buffer", None)
    if scratch is None or scratch.numel() < chunk * in_features or scratch.dtype != x.dtype:
        with torch.inference_mode(False):  # a normal tensor, writable in and out of inference mode
            scratch = _widen_scratch.buffer = torch.empty(chunk * in_features, dtype=x.dtype)
    for start in range(0, out_features, chunk):
        narrow = weight[start : start + chunk]
        wide = scratch[: narrow.numel()].view(narrow.shape).copy_(narrow)
        if transposed:
            torch.mm(wide, x.t(), out=out[start : start + chunk])
        else:
            torch.mm(x, wide.t(), out=out[:, start : start + chunk])
    if bias is not None:
        out += bias.unsqueeze(1) if transposed else bias
    return out.t() if transposed else out


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
