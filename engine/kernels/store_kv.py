"""KV store: write each new token's K/V rows into its slot of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check_launchable, check_paged_cache, check_tensor

TILE_ELEMS = 4096  # elements of K (and of V) one program moves: a few tokens of a real model


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, negative = padding token, not stored
    num_tokens,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Rows of the tile are (token, kv head) pairs: row = token * BLOCK_H + head.
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + r // BLOCK_H  # [BLOCK_T * BLOCK_H]
    h = r % BLOCK_H
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    row_mask = (slot >= 0) & (h < num_kv_heads)
    mask = row_mask[:, None] & (d[None, :] < head_dim)  # [BLOCK_T * BLOCK_H, BLOCK_D]

    k = tl.load(key_ptr + (tok * stride_k_tok + h * stride_k_head)[:, None] + d[None, :], mask=mask)
    v = tl.load(value_ptr + (tok * stride_v_tok + h * stride_v_head)[:, None] + d[None, :], mask=mask)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    dst = (blk * stride_c_blk + off * stride_c_slot + h * stride_c_head)[:, None] + d[None, :]
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write ``key[i]``/``value[i]`` into cache slot ``slot_mapping[i]``, in place.

    Slot ``s`` is row ``s % block_size`` of block ``s // block_size``. A negative slot marks a
    padding token (e.g. a CUDA-graph batch padded to a captured size) and is skipped.

    Raises:
        ValueError / TypeError: on shapes, strides, dtypes or devices the kernel cannot take.
    """
    device = key.device
    num_blocks, block_size, num_kv_heads, head_dim = check_paged_cache(
        key_cache, value_cache, key_cache.dtype, device
    )
    check_tensor("key", key, 3, key_cache.dtype, device)
    check_tensor("value", value, 3, key_cache.dtype, device)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64, torch.int32), device)
    num_tokens = key.shape[0]
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [{num_tokens}, {num_kv_heads}, {head_dim}] to match the cache, "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value head_dim must be contiguous")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    check_launchable(_store_kv_kernel, device)
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    block_t = max(1, TILE_ELEMS // (block_h * block_d))
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
