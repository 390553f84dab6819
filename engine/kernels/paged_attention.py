"""Paged decode attention: one query token per sequence, split over the context (flash-decoding).

A decode batch has little parallelism across (sequence, kv head) pairs; with long contexts
each program would walk thousands of tokens alone. The context is therefore cut into
``num_splits`` partitions, each attended by its own program, and a second kernel merges the
partial results with their log-sum-exps:

    context  |<- partition 0 ->|<- partition 1 ->|<- partition 2 ->|  (last one may be short/empty)
    kernel 1:  (o_0, lse_0)       (o_1, lse_1)       (o_2, lse_2)      o_i normalised within i
    kernel 2:  out = sum_i exp2(lse_i - max) * o_i / sum_i exp2(lse_i - max)

With one split the first kernel writes the output directly and the reduce is skipped. The split
count is a runtime argument (only whether there is a split is compiled in), so a changing
context length does not recompile. With a sliding window W the partitions cover the last W keys
of each context only; a soft cap bends the scaled scores to ``cap * tanh(score / cap)``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    check_attention_operands,
    check_launchable,
    check_tensor,
    dot_precision,
    get_num_sms,
    head_block,
)
from engine.kernels.context_tile import load_kv_tile, softmax_update, tile_scores

TILE_N = 64  # context tokens per inner-loop step; independent of the cache block size
MIN_PARTITION = 256  # tokens; below this the reduce's cost outweighs the parallelism (untuned on GPU)
MAX_SPLITS = 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Partitions per sequence so that a decode batch fills ``num_sms`` streaming multiprocessors.

    One split when the (sequence, kv head) programs already cover the GPU; otherwise enough to
    reach about two programs per SM, but never partitions shorter than ``MIN_PARTITION`` tokens.
    """
    num_programs = num_seqs * num_kv_heads
    if num_programs >= num_sms:
        return 1
    by_occupancy = math.ceil(2 * num_sms / num_programs)
    by_length = math.ceil(max_seq_len / MIN_PARTITION)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [num_seqs, num_q_heads, head_dim]; written when not SPLIT
    part_out_ptr,  # [num_seqs, num_q_heads, num_splits, head_dim] fp32, normalised per split
    part_lse_ptr,  # [num_seqs, num_q_heads, num_splits] fp32, log2-sum-exp2 of the scaled scores
    q_ptr,  # [num_seqs, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32, >= 1
    scale_log2,  # softmax scale * log2(e): scores live in the exp2 domain
    softcap_log2,  # soft cap * log2(e) (read with SOFTCAP)
    window,  # sliding window in tokens (read with SLIDING)
    partition_size,  # tokens per split, a multiple of TILE_N
    num_splits,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    num_queries_per_kv,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_G: tl.constexpr,  # query heads per kv head, padded to >= 16 for tl.dot
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partial results for the reduce
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0  # the first key the query sees
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
    start = first + split * partition_size
    if start >= seq_len:
        return  # NOTE: the reduce ignores splits past cdiv(seq_len, partition_size)
    end = tl.minimum(seq_len, start + partition_size)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_heads = kv_head * num_queries_per_kv + g  # [BLOCK_G]
    g_mask = g < num_queries_per_kv
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + seq * stride_q_tok + q_heads[:, None] * stride_q_head + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)  # [TILE_N] context positions
        pos_mask = pos < end
        k, v = load_kv_tile(key_cache_ptr, value_cache_ptr, bt_row, pos, pos_mask, d, d_mask, kv_head,
                            stride_c_blk, stride_c_slot, stride_c_head, BLOCK_SIZE)
        s = tile_scores(q, k, scale_log2, softcap_log2, DOT_PRECISION, SOFTCAP)  # [BLOCK_G, TILE_N]
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        # NOTE: every tile holds >= 1 valid position, so the maximum is finite and nothing is NaN.
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION, False)

    acc = acc / l_i[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        o_off = seq * stride_o_tok + q_heads[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row_id = (seq * tl.num_programs(1) * num_queries_per_kv + q_heads) * num_splits + split
        tl.store(part_out_ptr + row_id[:, None] * head_dim + d[None, :], acc, mask=out_mask)
        tl.store(part_lse_ptr + row_id, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [num_seqs, num_q_heads, head_dim]
    part_out_ptr,  # [num_seqs, num_q_heads, num_splits, head_dim] fp32
    part_lse_ptr,  # [num_seqs, num_q_heads, num_splits] fp32
    seq_lens_ptr,  # [num_seqs] int32
    window,  # sliding window in tokens (read with SLIDING)
    partition_size,
    num_splits,
    stride_o_tok,
    stride_o_head,
    head_dim,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
    BLOCK_D: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if SLIDING:
        seq_len = tl.minimum(seq_len, window)  # the keys the partitions cover
    num_valid = tl.cdiv(seq_len, partition_size)

    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_valid
    row = (seq * tl.num_programs(1) + head) * num_splits + s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # [BLOCK_S]; 0 for the splits past the context
    o = tl.load(
        part_out_ptr + row[:, None] * head_dim + d[None, :],
        mask=s_mask[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    o_off = seq * stride_o_tok + head * stride_o_head + d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """Attention of one query token per sequence over its whole cached context (or its window's).

    Args:
        q: the query of each sequence's newest token (its K/V already in the cache).
        key_cache, value_cache: the paged caches of one layer.
        block_tables: physical block of each logical block, padded past each sequence's blocks.
        seq_lens: context length of each sequence, >= 1, the new token included.
        max_seq_len: an upper bound of ``seq_lens`` known on the host (sizes the grid, no sync).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        num_splits: context partitions per sequence; ``None`` picks by ``choose_num_splits``.
            A fixed value keeps the grid fixed (CUDA graphs) and lets tests force the split.
        sliding_window: W: the query sees the last W keys of its context only; None: all of them.
        logit_softcap: c: scaled scores s become ``c * tanh(s / c)``; None: left as they are.

    Returns:
        A new tensor of ``q``'s shape and dtype.

    Raises:
        ValueError / TypeError: on shapes, strides, dtypes or devices the kernel cannot take.
    """
    device = q.device
    block_size, num_kv_heads, head_dim, group = check_attention_operands(q, key_cache, value_cache, block_tables)
    check_tensor("seq_lens", seq_lens, 1, torch.int32, device)
    num_seqs, num_q_heads = q.shape[0], q.shape[1]
    if seq_lens.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"decode takes one query per sequence: q has {num_seqs} tokens, seq_lens "
            f"{seq_lens.shape[0]} and block_tables {block_tables.shape[0]} rows"
        )
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds the block tables' {block_tables.shape[1]} blocks"
        )
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1 for a decode batch, got {max_seq_len}")
    check_launchable(_paged_decode_kernel, device)

    span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)  # keys a query sees
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, span, get_num_sms(device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    partition_size = triton.cdiv(triton.cdiv(span, num_splits), TILE_N) * TILE_N
    num_splits = triton.cdiv(span, partition_size)  # drop splits that no sequence reaches

    block_d = head_block(head_dim)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=device)
    else:
        part_out = part_lse = out  # unused by the kernel without SPLIT
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out,
        part_out,
        part_lse,
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale * math.log2(math.e),
        (logit_softcap or 1.0) * math.log2(math.e),
        sliding_window or 0,
        partition_size,
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        group,
        head_dim,
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        SPLIT=num_splits > 1,
        DOT_PRECISION=dot_precision(q.dtype),
        SOFTCAP=logit_softcap is not None,
        SLIDING=sliding_window is not None,
        num_warps=4,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_seqs, num_q_heads)](
            out,
            part_out,
            part_lse,
            seq_lens,
            sliding_window or 0,
            partition_size,
            num_splits,
            out.stride(0),
            out.stride(1),
            head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            SLIDING=sliding_window is not None,
            num_warps=4,
        )
    return out
