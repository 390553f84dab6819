"""Sliding-window and soft-capped attention in the Triton kernels against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from paged_cases import check_against_reference, make_batch, poison_before_windows

from engine.kernels import paged_decode_attention, prefill_attention, store_kv


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize(
    ("window", "seqs"),
    [
        (5, [(45, 45), (30, 9), (3, 3)]),  # windows shorter than a block and than a program's queries
        (24, [(90, 25), (70, 70), (20, 1)]),  # a window across blocks, after a cached prefix
        (200, [(45, 45), (17, 2)]),  # a window longer than every context: plain causal attention
    ],
)
def test_prefill_window_and_softcap(window: int, seqs: list[tuple[int, int]], softcap: float | None) -> None:
    """Each query sees its last ``window`` keys, scores soft-capped; blocks before every window are unread."""
    b = make_batch(seqs, block_size=8)
    b.scale = 0.8  # large enough that the soft cap bends the scores
    poison_before_windows(b, window)
    kc, vc, m = b.kv_cache[0], b.kv_cache[1], b.meta
    store_kv(b.k, b.v, kc, vc, m.slot_mapping)
    out = prefill_attention(
        b.q, kc, vc, m.block_tables, m.query_start_loc, m.seq_lens, m.max_query_len, b.scale, window, softcap
    )
    check_against_reference(b, out, window, softcap)


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 20, 150])
def test_decode_window_and_softcap(window: int, num_splits: int, softcap: float | None) -> None:
    """A decode query sees its context's last ``window`` keys, split or not; blocks before them are unread."""
    b = make_batch([(100, 1), (37, 1), (7, 1), (130, 1)], block_size=8)
    b.scale = 0.8
    poison_before_windows(b, window)
    kc, vc, m = b.kv_cache[0], b.kv_cache[1], b.meta
    store_kv(b.k, b.v, kc, vc, m.slot_mapping)
    out = paged_decode_attention(
        b.q, kc, vc, m.block_tables, m.seq_lens, m.max_seq_len, b.scale, num_splits=num_splits,
        sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    check_against_reference(b, out, window, softcap)


def test_soft_cap_saturates_without_overflow() -> None:
    """Scores far beyond the cap come out at +-cap, not NaN (the exponent is clamped)."""
    b = make_batch([(40, 40)], block_size=8)
    b.q *= 1e4
    kc, vc, m = b.kv_cache[0], b.kv_cache[1], b.meta
    store_kv(b.k, b.v, kc, vc, m.slot_mapping)
    out = prefill_attention(b.q, kc, vc, m.block_tables, m.query_start_loc, m.seq_lens, 40, b.scale, None, 2.0)
    check_against_reference(b, out, None, 2.0)
