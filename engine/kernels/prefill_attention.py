"""Varlen prefill attention over a cached prefix, read through the block table.

Sequence ``i`` brings ``query_len_i`` new tokens at the end of a context of ``seq_len_i``
tokens; its earlier ``seq_len_i - query_len_i`` tokens are already in the paged cache (a
shared prefix, an earlier chunk, or earlier decode steps) and the new ones were stored just
before. Every query attends causally to the whole context:

    context positions   0 ............ context_len-1 | context_len ........ seq_len-1
                        cached prefix: fully visible | new tokens: causal (kv_pos <= q_pos)

One program owns ``BLOCK_Q`` consecutive query tokens of one sequence and all the query heads
that share one kv head (GQA), packed as rows ``token * BLOCK_G + head`` of one tile, so each K/V
tile is loaded once for the whole group. Decode rows (query_len 1) in a mixed batch thus cost a
tile of ``BLOCK_G`` rows, not one of ``BLOCK_M``.

A sliding window W hides keys more than W - 1 positions behind each query; a program then reads
from the first key its first query sees, so blocks before it are never touched. A soft cap bends
the scaled scores to ``cap * tanh(score / cap)`` before the softmax.
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
    head_block,
)
from engine.kernels.context_tile import load_kv_tile, softmax_update, tile_scores

BLOCK_M = 64  # query rows (tokens x heads of a group) per program
TILE_N = 64  # context tokens per inner-loop step; independent of the cache block size


@triton.jit
def _prefill_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32, new tokens included
    scale_log2,  # softmax scale * log2(e): scores live in the exp2 domain
    softcap_log2,  # soft cap * log2(e) (read with SOFTCAP)
    window,  # sliding window in tokens (read with SLIDING)
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
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_G: tl.constexpr,  # query heads per kv head, padded to a power of two
    TILE_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    q_idx = q_block * BLOCK_Q + r // BLOCK_G  # [BLOCK_M] token within the sequence's queries
    g = r % BLOCK_G
    q_heads = kv_head * num_queries_per_kv + g
    row_mask = (q_idx < query_len) & (g < num_queries_per_kv)
    q_pos = context_len + q_idx  # [BLOCK_M] position of each row's token in the context
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + q_heads[:, None] * stride_q_head + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The last query of this block sees positions < kv_end; nothing beyond is loaded.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    kv_start = 0
    if SLIDING:  # the first query of this block sees positions > its own - window
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
    for tile_start in range(kv_start, kv_end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)  # [TILE_N] context positions
        pos_mask = pos < kv_end
        k, v = load_kv_tile(key_cache_ptr, value_cache_ptr, bt_row, pos, pos_mask, d, d_mask, kv_head,
                            stride_c_blk, stride_c_slot, stride_c_head, BLOCK_SIZE)
        s = tile_scores(q, k, scale_log2, softcap_log2, DOT_PRECISION, SOFTCAP)  # [BLOCK_M, TILE_N]
        visible = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # NOTE: without a window, position 0 is visible to every row and sits in the first tile, so the
        # maximum is finite from then on and fully masked rows of later tiles give p = 0. With one, a row
        # may see nothing of a tile yet.
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION, SLIDING)

    if SLIDING:  # padding rows past the chunk may have seen no key at all
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None]
    o_off = tok[:, None] * stride_o_tok + q_heads[:, None] * stride_o_head + d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of a varlen batch of new tokens over their sequences' paged contexts.

    Args:
        q: queries of the new tokens, sequences back to back.
        key_cache, value_cache: the paged caches of one layer, the new tokens' K/V already stored.
        block_tables: physical block of each logical block, padded past each sequence's blocks.
        query_start_loc: sequence ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i + 1]``,
            at context positions ``seq_lens[i] - query_len_i .. seq_lens[i] - 1``.
        seq_lens: context length of each sequence, new tokens included.
        max_query_len: an upper bound of the query lengths known on the host (sizes the grid).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: W: a query at position p sees keys p - W + 1 .. p only; None: all of them.
        logit_softcap: c: scaled scores s become ``c * tanh(s / c)``; None: left as they are.

    Returns:
        A new tensor of ``q``'s shape and dtype. Sequences may have any query length >= 1,
        so a batch mixing prefill chunks and decode tokens goes through here in one launch.

    Raises:
        ValueError / TypeError: on shapes, strides, dtypes or devices the kernel cannot take.
    """
    device = q.device
    block_size, num_kv_heads, head_dim, group = check_attention_operands(q, key_cache, value_cache, block_tables)
    check_tensor("query_start_loc", query_start_loc, 1, torch.int32, device)
    check_tensor("seq_lens", seq_lens, 1, torch.int32, device)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{num_seqs} sequences need query_start_loc of {num_seqs + 1} and block_tables of "
            f"{num_seqs} rows, got {query_start_loc.shape[0]} and {block_tables.shape[0]}"
        )
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    out = torch.empty_like(q)
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    check_launchable(_prefill_attention_kernel, device)

    block_g = triton.next_power_of_2(group)
    block_q = max(1, BLOCK_M // block_g)  # NOTE: rows = max(BLOCK_M, block_g) >= 16, as tl.dot needs
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _prefill_attention_kernel[grid](
        out,
        q,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * math.log2(math.e),
        (logit_softcap or 1.0) * math.log2(math.e),
        sliding_window or 0,
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
        BLOCK_Q=block_q,
        BLOCK_G=block_g,
        TILE_N=TILE_N,
        BLOCK_D=head_block(head_dim),
        DOT_PRECISION=dot_precision(q.dtype),
        SOFTCAP=logit_softcap is not None,
        SLIDING=sliding_window is not None,
        num_warps=4,
    )
    return out
