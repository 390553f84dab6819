"""Sliding-window and soft-capped attention in the Triton kernels against the float64 reference; every backend
over block tables whose entries before the windows are released (NULL_BLOCK)."""

from __future__ import annotations

import pytest
import torch
from paged_cases import check_against_reference, make_batch, poison_before_windows

from engine import cpu_kernels
from engine.attention import CpuAttentionBackend, TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
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


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param("cpu", marks=pytest.mark.skipif(cpu_kernels.library() is None, reason="no C kernels")),
        "triton",
    ],
)
@pytest.mark.parametrize(
    ("window", "seqs"),
    [
        (5, [(90, 25), (70, 1), (45, 45), (33, 1)]),  # prefill chunks and decodes in one batch
        (20, [(100, 1), (37, 1), (130, 1)]),  # decodes only (Triton's decode kernel)
    ],
)
def test_backends_never_read_released_table_entries(backend: str, window: int, seqs: list[tuple[int, int]]) -> None:
    """As a sliding KV cache group hands them over: the table entries before every window are NULL_BLOCK and
    their blocks NaN; each backend's output is the reference. (PyTorch's SDPA gathers whole blocks and masks the
    keys it does not see, so only the released blocks are NaN for it; the kernels read no unseen row at all.)"""
    b = make_batch(seqs, block_size=8, poison=backend != "torch")
    poison_before_windows(b, window)
    assert (b.meta.block_tables < 0).any()
    attention = {"torch": TorchAttentionBackend, "cpu": lambda: CpuAttentionBackend(2), "triton": TritonAttentionBackend}
    out = attention[backend]().forward(b.q, b.k, b.v, b.kv_cache, b.meta, b.scale, sliding_window=window)
    check_against_reference(b, out, window)
