"""The step both attention kernels take over a tile of a sequence's paged context: its K/V read from the
cache blocks, the queries' scores against them (soft-capped for Gemma 2), and the online softmax update.

Scores live in the exp2 domain (the softmax scale is premultiplied by log2(e)).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)`` elementwise, as ``cap - 2 cap / (exp(2 s / cap) + 1)``; the exponent is
    clamped to [-20, 20], past which tanh is +-1 in float32 and exp would overflow."""
    x = tl.minimum(tl.maximum(s * (2.0 / cap), -20.0), 20.0)
    return cap - 2.0 * cap / (tl.exp(x) + 1.0)


@triton.jit
def load_kv_tile(
    key_cache_ptr,
    value_cache_ptr,
    bt_row,  # the sequence's block table
    pos,  # [TILE_N] context positions
    pos_mask,  # [TILE_N] which of them to read
    d,  # [BLOCK_D] head_dim offsets
    d_mask,
    kv_head,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    BLOCK_SIZE: tl.constexpr,
):
    """K and V [TILE_N, BLOCK_D] of ``kv_head`` at context positions ``pos`` (zero where masked)."""
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    row = blk * stride_c_blk + (pos % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_head
    kv_mask = pos_mask[:, None] & d_mask[None, :]
    k = tl.load(key_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(value_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def tile_scores(q, k, scale_log2, softcap_log2, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """The scaled scores [rows, TILE_N] of the queries ``q`` against the tile's keys ``k``, soft-capped with SOFTCAP."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if SOFTCAP:
        s = soft_cap(s, softcap_log2)
    return s


@triton.jit
def softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, MAY_SEE_NONE: tl.constexpr):
    """The running maximum, sum and output ``(m_i, l_i, acc)`` with the masked scores ``s`` and values ``v`` of one
    tile folded in. MAY_SEE_NONE: a row may have no visible key in the tile yet (its maximum still -inf); its
    subtraction then uses 0, never NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_SEE_NONE:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
