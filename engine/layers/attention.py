"""Attention over the paged KV cache: one interface, a backend per device."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.forward_context import get_forward_context


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step addressing shared by every layer of one forward pass.

    Sequences are laid out back to back in the flat token batch; sequence ``i`` owns
    tokens ``query_start_loc[i] : query_start_loc[i + 1]``, which sit at positions
    ``seq_lens[i] - query_len_i .. seq_lens[i] - 1`` of its context.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (block_id * block_size + offset)
    query_start_loc: torch.Tensor  # [B + 1] int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence, new tokens included
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each sequence's blocks
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache, then attends causally over each sequence's context."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write ``k``/``v`` at ``meta.slot_mapping``, then return attention outputs for ``q``."""


class _TorchPlan(NamedTuple):
    """Host-side split of one step's batch, computed once and shared by every layer."""

    decode_tokens: torch.Tensor | None  # [Bd] int64 token rows of single-token sequences; None = all of them
    decode_blocks: torch.Tensor  # [Bd * max_blocks] int64 physical blocks to gather, row-major
    decode_mask: torch.Tensor  # [Bd, 1, 1, max_blocks * block_size] bool, True = key in context
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]  # start, end, ctx slots, mask


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain PyTorch, for the CPU (and as a portable fallback on GPU).

    Single-token (decode) sequences are served together: their context blocks are gathered
    into a reused workspace ``[Bd, max_ctx, Hkv, D]`` and one masked SDPA call attends for
    all of them, the query heads of a KV group folded into the query axis. Longer chunks
    (prefills) run one SDPA each: straight over the new K/V when nothing is cached before
    them, else over their context gathered from the cache with a causal mask.
    """

    def __init__(self) -> None:
        self._plan_meta: AttentionMetadata | None = None
        self._plan: _TorchPlan | None = None
        self._workspace: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        # NOTE: every new token's K/V is stored before any attention reads the cache, so a
        # sequence may read prefix blocks that another sequence of this batch writes now.
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

        plan = self._get_plan(meta, block_size)
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        if plan.decode_blocks.numel():
            q_dec = q if plan.decode_tokens is None else q.index_select(0, plan.decode_tokens)
            num_dec, max_ctx = q_dec.shape[0], plan.decode_mask.shape[-1]
            k_ctx, v_ctx = self._gather(kv_cache.view(2, num_blocks, -1), plan.decode_blocks)
            k_ctx = k_ctx.view(num_dec, max_ctx, num_kv_heads, head_dim).transpose(1, 2)  # [Bd, Hkv, L, D]
            v_ctx = v_ctx.view(num_dec, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
            q_dec = q_dec.view(num_dec, num_kv_heads, group, head_dim)  # a KV group's heads as its queries
            o = F.scaled_dot_product_attention(q_dec, k_ctx, v_ctx, attn_mask=plan.decode_mask, scale=scale)
            o = o.reshape(num_dec, num_heads, head_dim)
            if plan.decode_tokens is None:
                out = o
            else:
                out.index_copy_(0, plan.decode_tokens, o)
        for start, end, ctx_slots, mask in plan.prefills:
            q_seq = q[start:end].transpose(0, 1)  # [Hq, S, D]
            if ctx_slots is None:  # nothing cached before this chunk: its own K/V are the context
                k_seq, v_seq = k[start:end], v[start:end]
            else:
                k_seq = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, ctx_slots)
                v_seq = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, ctx_slots)
            o = F.scaled_dot_product_attention(
                q_seq,
                k_seq.transpose(0, 1),
                v_seq.transpose(0, 1),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=group > 1,
            )
            out[start:end] = o.transpose(0, 1)
        return out

    def _gather(self, kv_blocks: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: a reused workspace, not a fresh tensor per layer: allocating tens of MB per
        # layer costs more in page faults than the copy itself on CPU.
        numel = block_ids.numel() * kv_blocks.shape[-1]
        ws = self._workspace
        if ws is None or ws.shape[1] < numel or ws.dtype != kv_blocks.dtype or ws.device != kv_blocks.device:
            ws = self._workspace = torch.empty(2, numel, dtype=kv_blocks.dtype, device=kv_blocks.device)
        k_ctx = ws[0, :numel].view(block_ids.numel(), -1)
        v_ctx = ws[1, :numel].view(block_ids.numel(), -1)
        torch.index_select(kv_blocks[0], 0, block_ids, out=k_ctx)
        torch.index_select(kv_blocks[1], 0, block_ids, out=v_ctx)
        return k_ctx, v_ctx

    def _get_plan(self, meta: AttentionMetadata, block_size: int) -> _TorchPlan:
        if meta is not self._plan_meta:
            self._plan, self._plan_meta = _make_plan(meta, block_size), meta
        return self._plan


def _make_plan(meta: AttentionMetadata, block_size: int) -> _TorchPlan:
    device = meta.block_tables.device
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    decode_rows = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
    max_blocks = -(-max((seq_lens[i] for i in decode_rows), default=0) // block_size)
    rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
    decode_blocks = meta.block_tables[rows, :max_blocks].reshape(-1).long()
    key_pos = torch.arange(max_blocks * block_size, device=device)
    decode_mask = key_pos[None, :] < meta.seq_lens[rows, None]
    decode_tokens = None
    if len(decode_rows) != len(seq_lens):
        decode_tokens = meta.query_start_loc[rows].long()
    prefills = []
    for i in range(len(seq_lens)):
        start, end, ctx_len = starts[i], starts[i + 1], seq_lens[i]
        if end - start == 1:
            continue
        ctx_slots = mask = None
        if ctx_len > end - start:  # a cached prefix precedes the chunk: attend over the whole context
            blocks = meta.block_tables[i, : -(-ctx_len // block_size)].long()
            offsets = torch.arange(block_size, device=device)
            ctx_slots = (blocks[:, None] * block_size + offsets).reshape(-1)[:ctx_len]
            q_pos = torch.arange(ctx_len - (end - start), ctx_len, device=device)
            mask = torch.arange(ctx_len, device=device)[None, :] <= q_pos[:, None]  # [S, ctx]
        prefills.append((start, end, ctx_slots, mask))
    return _TorchPlan(decode_tokens, decode_blocks, decode_mask[:, None, None, :], prefills)


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


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` ("torch", "triton", or "auto": Triton on CUDA, PyTorch elsewhere)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        if device.type != "cuda":
            raise ValueError(f"the triton attention backend needs a CUDA device, got {device}")
        from engine.layers.triton_attention import TritonAttentionBackend  # lazy: imports triton

        return TritonAttentionBackend()
    raise ValueError(f"attention backend must be auto, torch or triton; got {name!r}")
