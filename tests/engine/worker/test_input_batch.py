"""Flattening scheduled requests into one varlen batch: exact ids, positions, slots and tables."""

from __future__ import annotations

import itertools
import random

import torch

from engine.core.scheduler_output import ScheduledRequest
from engine.worker.input_batch import prepare_inputs


def test_prefill_chunk_and_decode_flatten_exactly() -> None:
    """A chunk crossing blocks, a decode and a logits-less chunk give exact slots, tables and logits rows."""
    scheduled = [
        # positions 2..6 over blocks [7, 3]: slots 7*4+2, 7*4+3, 3*4+0, 3*4+1, 3*4+2
        ScheduledRequest("a", [10, 11, 12, 13, 14], 2, ([7, 3],), True),
        # one decode token at position 5 -> block 1 (id 9), offset 1
        ScheduledRequest("b", [20], 5, ([2, 9],), True),
        # a prefill chunk that does not reach the end of its prompt: no logits
        ScheduledRequest("c", [30, 31], 0, ([5, 6, 8],), False),
    ]
    inputs = prepare_inputs(scheduled, block_size=4, device=torch.device("cpu"))
    (meta,) = inputs.attn_metadata
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


def test_random_batches_follow_the_slot_contract() -> None:
    """Over random ragged batches every field equals its per-token definition from the scheduler contract."""
    rng = random.Random(0)
    for _ in range(20):
        scheduled = []
        for i in range(rng.randint(1, 9)):
            computed, n = rng.randint(0, 40), rng.choice([1, 1, rng.randint(1, 30)])
            blocks = rng.sample(range(200), -(-(computed + n) // 4) + rng.randint(0, 2))
            token_ids = [rng.randrange(1000) for _ in range(n)]
            scheduled.append(ScheduledRequest(str(i), token_ids, computed, (blocks,), rng.random() < 0.7))
        inputs = prepare_inputs(scheduled, block_size=4, device=torch.device("cpu"))
        per_token = [(r, p) for r in scheduled for p in range(r.num_computed_tokens, r.context_len)]
        positions = [p for _, p in per_token]
        slots = [r.block_ids[0][p // 4] * 4 + p % 4 for r, p in per_token]
        ends = list(itertools.accumulate(r.num_tokens for r in scheduled))
        assert inputs.input_ids.tolist() == [t for r in scheduled for t in r.token_ids]
        assert inputs.positions.tolist() == positions
        assert inputs.attn_metadata[0].slot_mapping.tolist() == slots
        assert inputs.attn_metadata[0].query_start_loc.tolist() == [0, *ends]
        assert inputs.logits_indices.tolist() == [end - 1 for r, end in zip(scheduled, ends) if r.needs_logits]
        width = max(len(r.block_ids[0]) for r in scheduled)
        padded = [r.block_ids[0] + [0] * (width - len(r.block_ids[0])) for r in scheduled]
        assert inputs.attn_metadata[0].block_tables.tolist() == padded
