"""Flattening a step's scheduled requests into one varlen batch (no padding between sequences)."""

from __future__ import annotations

from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.core.scheduler_output import ScheduledRequest


class ModelInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: tuple[AttentionMetadata, ...]  # per KV cache group: its block tables and slots
    logits_indices: torch.Tensor  # [num_logits] int64: rows of the batch whose next token is sampled or verified


def prepare_inputs(scheduled: list[ScheduledRequest], block_size: int, device: torch.device) -> ModelInputs:
    """Build every per-step tensor with vectorised numpy: one pass over the requests, one copy per field.

    Every KV cache group gets its own metadata (block tables, slot mapping); the groups' metadata share
    the query and sequence lengths.
    """
    n = len(scheduled)
    num_groups = len(scheduled[0].block_ids) if scheduled else 1
    num_computed = np.fromiter((r.num_computed_tokens for r in scheduled), np.int64, n)
    num_tokens = np.fromiter((len(r.token_ids) for r in scheduled), np.int64, n)
    num_blocks = np.fromiter((len(r.block_ids[0]) for r in scheduled), np.int64, n)
    needs_logits = np.fromiter((r.needs_logits for r in scheduled), bool, n)
    total = int(num_tokens.sum())
    input_ids = np.fromiter(chain.from_iterable(r.token_ids for r in scheduled), np.int64, total)
    query_start_loc = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(num_tokens, out=query_start_loc[1:])
    seq_lens = (num_computed + num_tokens).astype(np.int32)
    #   token t of request i sits at position p = num_computed[i] + (t - query_start_loc[i]),
    #   in slot block_tables[i, p // bs] * bs + p % bs of each group's tables
    rows = np.repeat(np.arange(n), num_tokens)
    positions = np.arange(total) + np.repeat(num_computed - query_start_loc[:-1], num_tokens)
    logits_indices = query_start_loc[1:][needs_logits].astype(np.int64) - 1
    if any(r.num_draft_tokens for r in scheduled):
        #   a request with d drafts gets the logits of its last 1 + d rows, in order
        num_logits = np.fromiter((r.num_logits for r in scheduled), np.int64, n)[needs_logits]
        offsets = logits_indices - num_logits + 1 - (np.cumsum(num_logits) - num_logits)  # row - its logits index
        logits_indices = np.arange(int(num_logits.sum())) + np.repeat(offsets, num_logits)
    in_table = np.arange(int(num_blocks.max(initial=0))) < num_blocks[:, None]

    def to_device(data: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(data).to(device, non_blocking=True)

    seq_lens_t, query_start_loc_t = to_device(seq_lens), to_device(query_start_loc)
    metas = []
    for group in range(num_groups):
        # NOTE: a sliding group's NULL_BLOCK entries (-1) lie before every window: no new token's slot is there
        block_tables = np.zeros(in_table.shape, dtype=np.int32)
        block_tables[in_table] = np.fromiter(
            chain.from_iterable(r.block_ids[group] for r in scheduled), np.int32, int(num_blocks.sum())
        )
        blocks = block_tables[rows, positions // block_size].astype(np.int64)
        slot_mapping = blocks * block_size + positions % block_size
        metas.append(
            AttentionMetadata(
                slot_mapping=to_device(slot_mapping),
                query_start_loc=query_start_loc_t,
                seq_lens=seq_lens_t,
                block_tables=to_device(block_tables),
                max_query_len=int(num_tokens.max(initial=0)),
                max_seq_len=int(seq_lens.max(initial=0)),
            )
        )
    return ModelInputs(
        input_ids=to_device(input_ids),
        positions=to_device(positions),
        attn_metadata=tuple(metas),
        logits_indices=to_device(logits_indices),
    )
