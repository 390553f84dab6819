"""The CPU attention backend: the PyTorch backend with decode rows served by a C kernel."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine import cpu_kernels
from engine.layers.attention import TorchAttentionBackend, prefix_groups


class _KernelDecodePlan(NamedTuple):
    """The decode rows of one step as the CPU kernel takes them."""

    tokens: torch.Tensor | None  # [Bd] int64 rows of q; None = every row of q, in order
    block_tables: torch.Tensor  # [Bd, max_blocks] int32
    seq_lens: torch.Tensor  # [Bd] int64
    tiles: cpu_kernels.DecodeTiles


def plan_tiles(seq_lens: np.ndarray, tables: np.ndarray, block_size: int, group: int) -> cpu_kernels.DecodeTiles:
    """The kernel's tiles for (at least one) decode rows: rows that begin with the same blocks
    (``prefix_groups``) in tiles of up to ``MAX_LANES // group``, every other row alone."""
    max_rows = max(1, cpu_kernels.MAX_LANES // group)
    starts, shared = [], []
    order, firsts, ends, prefix = prefix_groups(seq_lens, tables, block_size)
    for first, end, keys in zip(firsts.tolist(), ends.tolist(), prefix.tolist()):
        keys = keys if end - first > 1 and keys >= block_size else 0
        for start in range(first, end, max_rows if keys else 1):
            starts.append(start)
            shared.append(keys)
    return cpu_kernels.DecodeTiles(
        torch.from_numpy(order.astype(np.int64)),
        torch.tensor([*starts, len(seq_lens)], dtype=torch.int64),
        torch.tensor(shared, dtype=torch.int64),
    )


class CpuAttentionBackend(TorchAttentionBackend):
    """The PyTorch backend with the cache writes and the decode rows in C (``engine.cpu_kernels``), float32 on CPU.

    The kernel reads each row's context in place from the paged cache, one pass with an
    online softmax, so there is no gather and no padding mask. Rows whose tables begin with
    the same blocks (a shared system prompt) are tiled, and a tile's queries attend over
    those keys together, each key read once for all of them; each row then attends over its
    own keys alone. Prefill chunks keep the PyTorch path (SDPA).

    Args:
        group: query heads per KV head of the layers it serves (sizes the tiles).
    """

    def __init__(self, group: int) -> None:
        super().__init__(cascade=False)  # tiles replace the cascade plan; prefills are planned as in the parent
        self.group = group

    def _plan_decode(self, rows: np.ndarray, starts: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                     block_size: int, dtype: torch.dtype, device: torch.device) -> _KernelDecodePlan:
        tokens = None if len(rows) == len(starts) - 1 else torch.from_numpy(starts[rows])
        tables = np.ascontiguousarray(block_tables[rows], dtype=np.int32)
        lens = seq_lens[rows]
        return _KernelDecodePlan(
            tokens, torch.from_numpy(tables), torch.from_numpy(lens), plan_tiles(lens, tables, block_size, self.group)
        )

    def _store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
        cpu_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _KernelDecodePlan, scale: float) -> torch.Tensor:
        return cpu_kernels.decode_attention(
            q, kv_cache[0], kv_cache[1], plan.block_tables, plan.seq_lens, scale, plan.tiles
        )
