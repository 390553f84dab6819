"""The CPU attention backend: every query token, decode or prefill, through one C kernel over the paged cache."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine import cpu_kernels
from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.prefix import common_prefix

_SORT_BLOCKS = 64  # leading blocks of the tables that order the rows for tiling


class RowPlan(NamedTuple):
    """One step's query tokens as the kernel's rows; built once per step, shared by every layer."""

    block_tables: torch.Tensor  # [T, max_blocks] int32: each row's sequence's table
    seq_lens: torch.Tensor  # [T] int64: keys each row attends over (its position + 1)
    tiles: cpu_kernels.AttentionTiles


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


def plan_tiles(
    seq_lens: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    group: int,
    lanes: int,
    window: int | None = None,
    softcap: float | None = None,
) -> cpu_kernels.AttentionTiles:
    """The kernel's tiles: rows whose tables begin alike, side by side, up to ``lanes // group`` a tile
    (``lanes``: ``cpu_kernels.tile_lanes``). A tile shares no keys where a row's ``window`` starts past
    the first key, nor with a ``softcap`` (the kernel scores shared keys uncapped).

    Rows are ordered by their tables (so a sequence's prefill tokens, and sequences that share
    leading blocks, sit together), then by context length. A tile shares the keys every one
    of its rows has at the same place: the leading blocks all their tables agree on, capped
    at the tile's shortest context.
    """
    max_rows = max(1, lanes // group)
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
    if softcap is not None:
        shared[:] = 0
    elif window is not None:
        shared[np.maximum.reduceat(seq_lens, starts) > window] = 0
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

    Over a bfloat16 cache the kernel widens each element as it loads it (AMX tiles take a tile's
    shared keys where the CPU has them). Prefill chunks stay in the kernel: on every CPU measured it
    matched or beat PyTorch's SDPA in bfloat16 per chunk (AMD Zen 5, a step with int8 products: a
    fresh 512-token prompt 209 against 297 ms, 4 x 100 tokens after 288 cached 227 against 293; a
    Xeon with AMX and one without alike, docs/performance.md).

    Args:
        group: query heads per KV head of the layers it serves (sizes the tiles).
    """

    name = "cpu"

    def __init__(self, group: int) -> None:
        self.group = group
        self._lanes: int | None = None  # cpu_kernels.tile_lanes of the cache, on the first step
        # the step's plans by (metadata, window, softcap); a step's groups share its query_start_loc
        self._plan_step: torch.Tensor | None = None
        self._plans: dict[tuple[int, int | None, float | None], tuple[AttentionMetadata, RowPlan]] = {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As ``AttentionBackend.forward``; an int8 ``kv_cache`` comes with ``kv_scales`` [2, num_blocks, Hkv], the
        scales of its K and V per block and KV head."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        scales = None if kv_scales is None else (kv_scales[0], kv_scales[1])
        # NOTE: every new token's K/V is stored before any row reads the cache, so a row may read
        # keys that another token of this batch writes now (its own chunk, or a prefix being cached).
        cpu_kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, scales)
        plan = self.row_plan(meta, k_cache, sliding_window, logit_softcap)
        return cpu_kernels.attention(
            q, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale, plan.tiles, sliding_window, logit_softcap,
            scales,
        )

    def describe(self, cache_dtype: torch.dtype, head_dim: int) -> str:
        """E.g. ``cpu (bfloat16 cache; tiles of 48 queries, their shared keys on avx512-bf16)``."""
        on = cpu_kernels.bf16_attention_path(head_dim) if cache_dtype == torch.bfloat16 else "float32 vectors"
        lanes = cpu_kernels.tile_lanes(head_dim, cache_dtype)
        dtype = str(cache_dtype).removeprefix("torch.")
        if cache_dtype == torch.int8:
            dtype, on = "int8 codes and a scale per block and KV head", "float32 vectors"
        return f"cpu ({dtype} cache; tiles of {lanes} queries, their shared keys on {on})"

    def row_plan(
        self, meta: AttentionMetadata, k_cache: torch.Tensor, window: int | None = None, softcap: float | None = None
    ) -> RowPlan:
        """The step's query tokens as the kernel's rows and tiles over caches like ``k_cache`` for layers of
        this metadata (KV cache group), window and soft cap; built on a step's first such call, then the
        same for every such layer."""
        if self._lanes is None:
            self._lanes = cpu_kernels.tile_lanes(k_cache.shape[-1], k_cache.dtype)
        if meta.query_start_loc is not self._plan_step:
            self._plans, self._plan_step = {}, meta.query_start_loc
        key = (id(meta), window, softcap)
        held = self._plans.get(key)
        if held is None or held[0] is not meta:
            seq_lens, tables = token_rows(meta)
            tables = np.ascontiguousarray(tables, dtype=np.int32)
            tiles = plan_tiles(seq_lens, tables, k_cache.shape[1], self.group, self._lanes, window, softcap)
            held = self._plans[key] = (meta, RowPlan(torch.from_numpy(tables), torch.from_numpy(seq_lens), tiles))
        return held[1]
