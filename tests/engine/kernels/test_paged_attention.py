"""Paged decode attention (split-context) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from paged_cases import PagedBatch, check_against_reference, make_batch

from engine.kernels import choose_num_splits, paged_decode_attention, store_kv
from engine.kernels.paged_attention import MAX_SPLITS, MIN_PARTITION


def _decode(b: PagedBatch, num_splits: int | None = None) -> torch.Tensor:
    kc, vc = b.kv_cache[0], b.kv_cache[1]
    store_kv(b.k, b.v, kc, vc, b.meta.slot_mapping)
    m = b.meta
    return paged_decode_attention(b.q, kc, vc, m.block_tables, m.seq_lens, m.max_seq_len, b.scale, num_splits)


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 2, 32, 16), (4, 4, 16, 16), (8, 1, 64, 8), (6, 2, 24, 32)],
)
def test_decode_matches_reference(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """Ragged contexts (not block multiples, one of a single token) over scattered blocks, GQA and MHA."""
    b = make_batch(
        [(37, 1), (100, 1), (1, 1), (16, 1)],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    check_against_reference(b, _decode(b))


def test_decode_over_shared_prefix_blocks() -> None:
    """Sequences whose tables point at the same prefix blocks each see their own tail."""
    b = make_batch([(50, 1), (35, 1), (64, 1)], num_shared_blocks=2)
    assert b.block_ids[0][:2] == b.block_ids[1][:2] == b.block_ids[2][:2]
    check_against_reference(b, _decode(b))


@pytest.mark.parametrize("num_splits", [2, 3, 8])  # 8 asks for more splits than 64-token partitions fill
def test_split_context_matches_reference(num_splits: int) -> None:
    """Splitting the context (some sequences shorter than a partition) and reducing gives one softmax."""
    b = make_batch([(190, 1), (20, 1), (129, 1)], head_dim=16, num_q_heads=4, num_kv_heads=2)
    check_against_reference(b, _decode(b, num_splits))


def test_split_agrees_with_single_pass() -> None:
    """The split path and the single-pass path agree to fp32 rounding."""
    b = make_batch([(200, 1), (70, 1)], head_dim=16)
    cache = b.kv_cache.clone()
    one = _decode(b, 1)
    b.kv_cache.copy_(cache)
    many = _decode(b, 4)
    torch.testing.assert_close(one, many, atol=1e-5, rtol=1e-5)


def test_decode_half_precision() -> None:
    """fp16 inputs accumulate in fp32 and stay within fp16 tolerance (split and unsplit)."""
    b = make_batch([(140, 1), (33, 1)], dtype=torch.float16, head_dim=32)
    cache = b.kv_cache.clone()
    check_against_reference(b, _decode(b, 1))
    b.kv_cache.copy_(cache)
    check_against_reference(b, _decode(b, 3))


def test_choose_num_splits() -> None:
    """No split when the batch fills the GPU or the context is short; else ~2 programs per SM, capped."""
    assert choose_num_splits(num_seqs=64, num_kv_heads=4, max_seq_len=8192, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=MIN_PARTITION, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=4 * MIN_PARTITION, num_sms=132) == 4
    assert choose_num_splits(num_seqs=2, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 17
    assert choose_num_splits(num_seqs=1, num_kv_heads=1, max_seq_len=1 << 20, num_sms=132) == MAX_SPLITS


def test_decode_rejects_bad_inputs() -> None:
    """Mismatched heads, dtypes, batch sizes and too-short tables fail before launch."""
    b = make_batch([(20, 1), (9, 1)])
    kc, vc, m = b.kv_cache[0], b.kv_cache[1], b.meta
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        paged_decode_attention(b.q[:, :3], kc, vc, m.block_tables, m.seq_lens, m.max_seq_len, b.scale)
    with pytest.raises(TypeError, match="seq_lens must have dtype"):
        paged_decode_attention(b.q, kc, vc, m.block_tables, m.seq_lens.long(), m.max_seq_len, b.scale)
    with pytest.raises(ValueError, match="one query per sequence"):
        paged_decode_attention(b.q[:1], kc, vc, m.block_tables, m.seq_lens, m.max_seq_len, b.scale)
    with pytest.raises(ValueError, match="exceeds the block tables"):
        paged_decode_attention(b.q, kc, vc, m.block_tables, m.seq_lens, 1000, b.scale)
    with pytest.raises(TypeError, match="key_cache must have dtype"):
        paged_decode_attention(b.q.half(), kc, vc, m.block_tables, m.seq_lens, m.max_seq_len, b.scale)
