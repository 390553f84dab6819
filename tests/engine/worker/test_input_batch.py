"""Flattening scheduled requests into one varlen batch: exact ids, positions, slots and tables."""

from __future__ import annotations

import torch

from engine.core.scheduler_output import ScheduledRequest
from engine.worker.input_batch import prepare_inputs


def test_prefill_chunk_and_decode_flatten_exactly() -> None:
    """A chunk crossing blocks, a decode and a logits-less chunk give exact slots, tables and logits rows."""
    scheduled = [
        # positions 2..6 over blocks [7, 3]: slots 7*4+2, 7*4+3, 3*4+0, 3*4+1, 3*4+2
        ScheduledRequest("a", [10, 11, 12, 13, 14], 2, [7, 3], True),
        # one decode token at position 5 -> block 1 (id 9), offset 1
        ScheduledRequest("b", [20], 5, [2, 9], True),
        # a prefill chunk that does not reach the end of its prompt: no logits
        ScheduledRequest("c", [30, 31], 0, [5, 6, 8], False),
    ]
    inputs = prepare_inputs(scheduled, block_size=4, device=torch.device("cpu"))
    meta = inputs.attn_metadata
    assert inputs.input_ids.tolist() == [10, 11, 12, 13, 14, 20, 30, 31]
    assert inputs.positions.tolist() == [2, 3, 4, 5, 6, 5, 0, 1]
    assert meta.slot_mapping.tolist() == [30, 31, 12, 13, 14, 37, 20, 21]
    assert meta.query_start_loc.tolist() == [0, 5, 6, 8]
    assert meta.seq_lens.tolist() == [7, 6, 2]
    assert meta.block_tables.tolist() == [[7, 3, 0], [2, 9, 0], [5, 6, 8]]
    assert (meta.max_query_len, meta.max_seq_len) == (5, 7)
    assert inputs.logits_indices.tolist() == [4, 5]
    assert meta.slot_mapping.dtype == torch.int64 and meta.block_tables.dtype == torch.int32
    assert meta.query_start_loc.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
