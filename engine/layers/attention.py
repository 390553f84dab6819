"""The attention layer: one layer's attention over its slice of the paged KV cache, through a backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.worker.forward_context import get_forward_context

if TYPE_CHECKING:
    from engine.attention import AttentionBackend


class Attention(nn.Module):
    """One layer's attention over its slice of the paged KV cache.

    The runner binds ``kv_cache`` ([2, num_blocks, block_size, Hkv, D]) and ``backend``
    after allocating the cache; the step's metadata comes from the forward context.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context().attn_metadata
        o = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale)  # [T, Hq, D]
        return o.reshape(o.shape[0], self.num_heads * self.head_dim)
