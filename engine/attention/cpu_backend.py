"""The CPU attention backend: query tokens through one C kernel over the paged cache, long prefill chunks
of a bfloat16 cache through PyTorch's SDPA where the CPU multiplies bfloat16 but the kernel has no AMX."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.prefix import common_prefix

_SORT_BLOCKS = 64  # leading blocks of the tables that order the rows for tiling
DENSE_MIN_QUERY = 32  # a chunk of this many tokens of one sequence goes to SDPA (bfloat16 cache and CPU, no AMX)
DENSE_MIN_QUERY_MASKED = 64  # the same for a chunk after earlier context (SDPA with a mask, a slower call)


class _Chunk(NamedTuple):
    """A sequence's prefill chunk served by SDPA over its gathered context."""

    start: int  # its first row of the batch
    end: int
    blocks: torch.Tensor  # [ceil(context / block_size)] int64: the blocks its context occupies
    context: int  # keys: the chunk's last position + 1
    mask: torch.Tensor | None  # [end - start, context] bool, None when the chunk starts at position 0 (causal)


class _RowPlan(NamedTuple):
    """One step's query tokens as the kernel's rows and SDPA's chunks; built once per step, shared by every layer."""

    rows: torch.Tensor | None  # [R] int64: the batch rows the kernel serves; None: all of them
    block_tables: torch.Tensor  # [R, max_blocks] int32: each row's sequence's table
    seq_lens: torch.Tensor  # [R] int64: keys each row attends over (its position + 1)
    tiles: cpu_kernels.AttentionTiles | None  # None: no row for the kernel
    chunks: list[_Chunk]


def token_rows(meta: AttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
    """``(seq_lens, tables)`` of each query token of the batch: its causal context length and its sequence's table."""
    starts = meta.query_start_loc.numpy().astype(np.int64)
    seq_lens = meta.seq_lens.numpy().astype(np.int64)
    tables = meta.block_tables.numpy()
    query_lens = np.diff(starts)
    if (query_lens == 1).all():  # a pure decode step: one row per sequence
        return seq_lens, tables
    # token t of sequence i sits at position seq_lens[i] - (starts[i + 1] - t), so it sees that many keys plus one
    lens = np.arange(starts[-1]) + np.repeat(seq_lens - starts[1:] + 1, query_lens)
    return lens, np.repeat(tables, query_lens, axis=0)


def plan_tiles(seq_lens: np.ndarray, tables: np.ndarray, block_size: int, group: int) -> cpu_kernels.AttentionTiles:
    """The kernel's tiles: rows whose tables begin alike, side by side, up to ``MAX_LANES // group`` a tile.

    Rows are ordered by their tables (so a sequence's prefill tokens, and sequences that share
    leading blocks, sit together), then by context length. A tile shares the keys every one
    of its rows has at the same place: the leading blocks all their tables agree on, capped
    at the tile's shortest context.
    """
    max_rows = max(1, cpu_kernels.MAX_LANES // group)
    num_rows = len(seq_lens)
    # last key first: block 0, block 1, ..., then length. NOTE: by the first _SORT_BLOCKS blocks only (the sort
    # costs a pass per key); rows that agree on those and differ later may interleave, sharing what they agree on.
    order = np.lexsort((seq_lens, *tables[:, :_SORT_BLOCKS].T[::-1]))
    tables, seq_lens = tables[order], seq_lens[order]
    index = np.arange(num_rows)
    new_group = np.r_[True, tables[1:, 0] != tables[:-1, 0]]  # tiles never span two first blocks
    group_start = np.maximum.accumulate(np.where(new_group, index, 0))
    starts = np.flatnonzero((index - group_start) % max_rows == 0)
    shared = common_prefix(seq_lens, tables, starts, block_size)
    shared[np.diff(np.r_[starts, num_rows]) == 1] = 0  # a row alone has nothing to share
    return cpu_kernels.AttentionTiles(
        torch.from_numpy(order.astype(np.int64)),
        torch.from_numpy(np.r_[starts, num_rows].astype(np.int64)),
        torch.from_numpy(shared.astype(np.int64)),
    )


class CpuAttentionBackend(AttentionBackend):
    """Paged attention in C (``engine.cpu_kernels``), float32 on CPU, for decode and prefill alike.

    Every query token is a row of one kernel call: a decode token, or a token of a prefill
    chunk with its causal context (its position + 1 keys). The kernel reads each row's
    context in place from the paged cache with an online softmax, so there is no gather,
    no mask and no per-sequence loop. Rows whose tables begin with the same blocks (a
    shared system prompt, or the tokens of one prefill chunk) are tiled, and a tile's
    queries attend over those keys together, each key read once for all of them; each row
    then attends over its own keys alone.

    Over a bfloat16 cache on a CPU whose bfloat16 dot products out-run float32's FMAs
    (``cpu_kernels.bf16_linear_path`` is ``"avx512-bf16"``) and whose tiles have no AMX
    (``bf16_attention_path``), a chunk of at least ``DENSE_MIN_QUERY`` tokens of one sequence
    (``DENSE_MIN_QUERY_MASKED`` after earlier context, a cached prefix or an earlier chunk) is
    instead gathered and computed by
    PyTorch's SDPA in bfloat16, 3x faster than the float32 kernel at prefill (its queries rounded
    to bfloat16). Shorter chunks after a cached system prompt are faster in the kernel's tiles
    (47 tokens after 288: 1.25x), and longer ones in SDPA (100 after 288: 1.25x the other way).
    With AMX the tiles match SDPA on a fresh 512-token prompt and beat it after earlier context,
    so every row stays in the kernel; so it does where VDPBF16PS makes half FMA's products (a Xeon
    without AMX: a fresh 512-token prompt's step 809 against 869 ms in SDPA, 512 after 288 904
    against 974).

    Args:
        group: query heads per KV head of the layers it serves (sizes the tiles).
    """

    def __init__(self, group: int) -> None:
        self.group = group
        self._plan_meta: AttentionMetadata | None = None
        self._plan: _RowPlan | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        # NOTE: every new token's K/V is stored before any row reads the cache, so a row may read
        # keys that another token of this batch writes now (its own chunk, or a prefix being cached).
        cpu_kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = self._get_plan(meta, k_cache)
        if not plan.chunks:
            return cpu_kernels.attention(q, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale, plan.tiles)
        out = torch.empty(q.shape)
        if plan.tiles is not None:
            rows = cpu_kernels.attention(
                q.index_select(0, plan.rows), k_cache, v_cache, plan.block_tables, plan.seq_lens, scale, plan.tiles
            )
            out.index_copy_(0, plan.rows, rows)
        for chunk in plan.chunks:
            out[chunk.start : chunk.end] = _dense_chunk(q[chunk.start : chunk.end], k_cache, v_cache, chunk, scale)
        return out

    def _get_plan(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> _RowPlan:
        if meta is not self._plan_meta:
            block_size = k_cache.shape[1]
            dense = (
                k_cache.dtype == torch.bfloat16
                and cpu_kernels.bf16_linear_path(1) == "avx512-bf16"
                and cpu_kernels.bf16_attention_path(k_cache.shape[-1]) != "amx"
            )
            seq_lens, tables = token_rows(meta)
            chunks = _dense_chunks(meta, block_size) if dense else []
            rows = None
            if chunks:
                keep = np.ones(len(seq_lens), dtype=bool)
                for chunk in chunks:
                    keep[chunk.start : chunk.end] = False
                rows = np.flatnonzero(keep)
                seq_lens, tables = seq_lens[rows], tables[rows]
            tables = np.ascontiguousarray(tables, dtype=np.int32)
            tiles = plan_tiles(seq_lens, tables, block_size, self.group) if len(seq_lens) else None
            self._plan = _RowPlan(
                None if rows is None else torch.from_numpy(rows.astype(np.int64)), torch.from_numpy(tables),
                torch.from_numpy(seq_lens), tiles, chunks,
            )  # fmt: skip
            self._plan_meta = meta
        return self._plan


def _dense_chunks(meta: AttentionMetadata, block_size: int) -> list[_Chunk]:
    """The sequences of a step with at least ``DENSE_MIN_QUERY`` new tokens (``DENSE_MIN_QUERY_MASKED`` after
    earlier context), as SDPA's chunks."""
    starts = meta.query_start_loc.tolist()
    chunks = []
    for i, context in enumerate(meta.seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        offset = context - (end - start)  # the chunk's first position
        if end - start < (DENSE_MIN_QUERY if offset == 0 else DENSE_MIN_QUERY_MASKED):
            continue
        blocks = meta.block_tables[i, : -(-context // block_size)].to(torch.int64)
        mask = None if offset == 0 else torch.ones(end - start, context, dtype=torch.bool).tril(offset)
        chunks.append(_Chunk(start, end, blocks, context, mask))
    return chunks


def _dense_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: _Chunk, scale: float):
    """Causal attention of a chunk's queries [n, Hq, D] over its context, gathered from the cache, in bfloat16."""
    k, v = (cache[chunk.blocks].flatten(0, 1)[: chunk.context].transpose(0, 1).unsqueeze(0) for cache in (k_cache, v_cache))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).to(torch.bfloat16), k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None,
        scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)
