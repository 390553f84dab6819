"""The CPU attention backend: the PyTorch backend with decode rows served by a C kernel."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine import cpu_kernels
from engine.layers.attention import TorchAttentionBackend


class _KernelDecodePlan(NamedTuple):
    """The decode rows of one step as the CPU kernel takes them."""

    tokens: torch.Tensor | None  # [Bd] int64 rows of q; None = every row of q, in order
    block_tables: torch.Tensor  # [Bd, max_blocks] int32
    seq_lens: torch.Tensor  # [Bd] int64


class CpuAttentionBackend(TorchAttentionBackend):
    """The PyTorch backend with the cache writes and the decode rows in C (``engine.cpu_kernels``), float32 on CPU.

    The kernel reads each row's context in place from the paged cache, one pass with an
    online softmax, so there is no gather, no padding mask, and no separate cascade path:
    rows that share prefix blocks are processed in order and find them in cache. Prefill
    chunks keep the PyTorch path (SDPA).
    """

    def __init__(self) -> None:
        super().__init__(cascade=False)  # the kernel needs no cascade plan; prefills are planned as in the parent

    def _plan_decode(self, rows: np.ndarray, starts: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                     block_size: int, dtype: torch.dtype, device: torch.device) -> _KernelDecodePlan:
        tokens = None if len(rows) == len(starts) - 1 else torch.from_numpy(starts[rows])
        tables = np.ascontiguousarray(block_tables[rows], dtype=np.int32)
        return _KernelDecodePlan(tokens, torch.from_numpy(tables), torch.from_numpy(seq_lens[rows]))

    def _store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
        cpu_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _KernelDecodePlan, scale: float) -> torch.Tensor:
        return cpu_kernels.decode_attention(q, kv_cache[0], kv_cache[1], plan.block_tables, plan.seq_lens, scale)
