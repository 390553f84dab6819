"""KV store: write each new token's K/V rows into its slot of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check_launchable, check_paged_cache, check_tensor


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, negative = padding token, not stored
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
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]

    k = tl.load(key_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
    dst = blk * stride_c_blk + off * stride_c_slot + h[:, None] * stride_c_head + d[None, :]
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
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
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
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
