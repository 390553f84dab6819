"""The attention interface: the per-step metadata every backend reads, and the backend ABC."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step addressing shared by every layer of one KV cache group in one forward pass.

    Sequences are laid out back to back in the flat token batch; sequence ``i`` owns
    tokens ``query_start_loc[i] : query_start_loc[i + 1]``, which sit at positions
    ``seq_lens[i] - query_len_i .. seq_lens[i] - 1`` of its context.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (block_id * block_size + offset)
    query_start_loc: torch.Tensor  # [B + 1] int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence, new tokens included
    # [B, max_blocks] int32, padded with 0 past each sequence's blocks; -1 (NULL_BLOCK) for blocks a sliding
    # window released: they lie before the first key any query of the step reads, and no backend reads them
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache, then attends causally over each sequence's context."""

    name: str  # the name ``EngineConfig.attention_backend`` takes

    def describe(self, cache_dtype: torch.dtype, head_dim: int) -> str:
        """What serves attention over a cache of this dtype and head_dim (the start-up log, ``Engine.stats()``)."""
        return self.name

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write ``k``/``v`` at ``meta.slot_mapping``, then return attention outputs for ``q``.

        ``sliding_window`` W limits a query at position p to the keys at p - W + 1 .. p;
        ``logit_softcap`` c turns each scaled score s into ``c * tanh(s / c)`` (``Attention``).
        """
