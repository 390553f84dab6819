"""The attention layer: one layer's attention over its slice of the paged KV cache, through a backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.forward_context import get_forward_context

if TYPE_CHECKING:
    from engine.attention import AttentionBackend


class Attention(nn.Module):
    """One layer's attention over its slice of the paged KV cache.

    The runner binds ``kv_cache`` ([2, num_blocks, block_size, Hkv, D]), ``backend`` and
    ``kv_cache_group`` (the KV cache group of the layers of its window) after allocating the
    cache; the step's metadata of that group comes from the forward context.

    Args:
        sliding_window: W: a query at position p sees the keys at positions p - W + 1 .. p
            (transformers' convention); None sees its whole context.
        logit_softcap: c: scores (after ``scale``) become ``c * tanh(score / c)`` before the
            softmax (Gemma 2); None leaves them as they are.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"logit_softcap must be > 0 or None, got {logit_softcap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # an int8 cache's: [2, num_blocks, Hkv]
        self.backend: AttentionBackend | None = None
        self.kv_cache_group = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context().attn_metadata[self.kv_cache_group]
        scales = {} if self.kv_scales is None else {"kv_scales": self.kv_scales}  # the cpu backend's, for int8
        o = self.backend.forward(
            q, k, v, self.kv_cache, meta, self.scale,
            sliding_window=self.sliding_window, logit_softcap=self.logit_softcap, **scales,
        )  # fmt: skip
        return o.reshape(o.shape[0], self.num_heads * self.head_dim)
