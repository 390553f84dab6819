"""The GPU attention backend: Triton kernels over the paged KV cache.

Imported lazily (by ``get_attention_backend`` when it picks this backend): importing it imports
``engine.kernels``, whose kernels are bound to the GPU or to Triton's CPU interpreter at
that moment.
"""

from __future__ import annotations

import torch

from engine.kernels import paged_decode_attention, prefill_attention, store_kv
from engine.attention.backend import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Stores new K/V with one kernel, then attends with the decode or the prefill kernel.

    A batch whose every sequence has one new token (``max_query_len == 1``) takes the
    split-context decode kernel; any other batch, mixed prefill and decode included, takes
    the varlen prefill kernel.

    Args:
        decode_num_splits: context partitions per sequence for decode batches; ``None`` picks
            by occupancy and context length. A fixed value keeps the decode grid fixed.
    """

    name = "triton"

    def __init__(self, decode_num_splits: int | None = None) -> None:
        if decode_num_splits is not None and decode_num_splits < 1:
            raise ValueError(f"decode_num_splits must be >= 1, got {decode_num_splits}")
        self.decode_num_splits = decode_num_splits

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
        if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
            raise ValueError(
                f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
                f"got {tuple(kv_cache.shape)}"
            )
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # q/k/v may be strided views of one fused projection (see Linear); the kernels need unit-stride heads.
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        store_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        if meta.max_query_len == 1:
            return paged_decode_attention(
                q,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.max_seq_len,
                scale,
                num_splits=self.decode_num_splits,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        return prefill_attention(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.max_query_len,
            scale,
            sliding_window,
            logit_softcap,
        )
