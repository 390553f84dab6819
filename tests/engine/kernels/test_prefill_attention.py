"""Varlen prefill attention over a cached prefix against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from paged_cases import PagedBatch, check_against_reference, make_batch

from engine.kernels import prefill_attention, store_kv


def _prefill(b: PagedBatch) -> torch.Tensor:
    kc, vc, m = b.kv_cache[0], b.kv_cache[1], b.meta
    store_kv(b.k, b.v, kc, vc, m.slot_mapping)
    return prefill_attention(b.q, kc, vc, m.block_tables, m.query_start_loc, m.seq_lens, m.max_query_len, b.scale)


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 2, 32, 16), (2, 2, 16, 16), (8, 2, 64, 32), (3, 1, 24, 8)],
)
def test_prefill_from_empty_cache(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """Whole prompts (lengths off block boundaries) attend causally to themselves, GQA and MHA."""
    b = make_batch(
        [(45, 45), (17, 17), (3, 3)],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    check_against_reference(b, _prefill(b))


def test_prefill_over_cached_prefix() -> None:
    """A chunk after a cached prefix sees all of the prefix and its own tokens causally."""
    b = make_batch([(90, 25), (40, 9), (70, 70)])
    check_against_reference(b, _prefill(b))


def test_prefill_over_shared_prefix_blocks() -> None:
    """Two sequences reading the same physical prefix blocks get their own tails' attention."""
    b = make_batch([(60, 20), (52, 12)], num_shared_blocks=2)
    assert b.block_ids[0][:2] == b.block_ids[1][:2]
    check_against_reference(b, _prefill(b))


def test_mixed_prefill_and_decode_batch() -> None:
    """Decode tokens (query_len 1) and prefill chunks share one launch; each row is exact."""
    b = make_batch([(33, 1), (80, 48), (100, 1), (16, 16), (21, 2)], num_q_heads=8, num_kv_heads=2)
    check_against_reference(b, _prefill(b))


def test_query_block_boundaries() -> None:
    """Queries spanning several query blocks of a program (MHA: 64 tokens per block) stay causal."""
    b = make_batch([(100, 100)], num_q_heads=2, num_kv_heads=2, head_dim=16)
    check_against_reference(b, _prefill(b))


def test_prefill_half_precision() -> None:
    """fp16 inputs accumulate in fp32 and stay within fp16 tolerance."""
    b = make_batch([(70, 30), (25, 1), (40, 40)], dtype=torch.float16)
    check_against_reference(b, _prefill(b))


def test_prefill_rejects_bad_inputs() -> None:
    """Mismatched query_start_loc, dtypes and head_dim fail before launch."""
    b = make_batch([(20, 5), (9, 9)])
    kc, vc, m = b.kv_cache[0], b.kv_cache[1], b.meta
    with pytest.raises(ValueError, match="need query_start_loc of 3"):
        prefill_attention(b.q, kc, vc, m.block_tables, m.query_start_loc[:2], m.seq_lens, m.max_query_len, b.scale)
    with pytest.raises(TypeError, match="block_tables must have dtype"):
        prefill_attention(b.q, kc, vc, m.block_tables.long(), m.query_start_loc, m.seq_lens, m.max_query_len, b.scale)
    with pytest.raises(ValueError, match="head_dim"):
        prefill_attention(b.q[..., :16], kc, vc, m.block_tables, m.query_start_loc, m.seq_lens, 9, b.scale)
