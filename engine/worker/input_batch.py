"""Flattening a step's scheduled requests into one varlen batch (no padding between sequences)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine.core.scheduler_output import ScheduledRequest
from engine.layers.attention import AttentionMetadata


class ModelInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] int64: rows of the batch whose next token is sampled


def prepare_inputs(scheduled: list[ScheduledRequest], block_size: int, device: torch.device) -> ModelInputs:
    """Build every per-step tensor from plain Python lists: one host tensor per field, one copy each."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    max_blocks = max((len(r.block_ids) for r in scheduled), default=0)
    block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
    for i, req in enumerate(scheduled):
        start, end = req.num_computed_tokens, req.context_len
        block_ids = req.block_ids
        input_ids.extend(req.token_ids)
        positions.extend(range(start, end))
        #   positions  start ........................ end
        #   blocks     |  b = start // bs  | ... | b = (end - 1) // bs |
        #   slot(p) = block_ids[b] * bs + (p - b * bs), one contiguous run per block
        for b in range(start // block_size, (end - 1) // block_size + 1):
            lo, hi = max(start, b * block_size), min(end, (b + 1) * block_size)
            shift = (block_ids[b] - b) * block_size
            slot_mapping.extend(range(lo + shift, hi + shift))
        query_start_loc.append(len(input_ids))
        seq_lens.append(end)
        if req.needs_logits:
            logits_indices.append(len(input_ids) - 1)
        block_tables[i, : len(block_ids)] = block_ids

    def to_device(data: list[int] | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        host = torch.from_numpy(data) if isinstance(data, np.ndarray) else torch.tensor(data, dtype=dtype)
        return host.to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, torch.int64),
        query_start_loc=to_device(query_start_loc, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        block_tables=to_device(block_tables, torch.int32),
        max_query_len=max((r.num_tokens for r in scheduled), default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return ModelInputs(
        input_ids=to_device(input_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        attn_metadata=meta,
        logits_indices=to_device(logits_indices, torch.int64),
    )
