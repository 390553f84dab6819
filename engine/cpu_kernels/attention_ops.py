"""The attention kernels' wrappers: paged attention of query-token rows over a float32, bfloat16 or int8 cache and
the new tokens' cache writes (``attention.c``, ``attention_bf16.c``, ``attention_i8.c``), with the shapes they take
and the paths they run on this CPU.

An int8 cache holds codes, and beside each of K and V a float32 scale per block and KV head (``[num_blocks,
Hkv]``): an element is its code times its block's scale for its head."""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.cpu_kernels._operands import DTYPE_SUFFIX, as_int64, check_float32_cpu
from engine.cpu_kernels.build import ATTENTION_FETCH, BF16_ATTENTION_PATHS, loaded

# Fixed-size scratch of the kernels (see MAX_* in the sources).
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 256
_SUFFIX = {**DTYPE_SUFFIX, torch.int8: "i8"}  # of the attention kernels' names, by the cache's dtype
AMX_TILE_LANES = 24  # queries of a tile whose shared keys take AMX tiles


def attention_fetch() -> str:
    """The cache level the attention kernels fetch keys and values ahead into on this CPU: ``l1`` or ``l2``."""
    return ATTENTION_FETCH[loaded().attention_fetch_level()]


def tile_lanes(head_dim: int, dtype: torch.dtype) -> int:
    """The most queries (rows x query heads of a KV group) a multi-row tile of ``attention`` should hold over a
    cache of this head_dim and dtype: 48 where the kernels have AVX-512 (three 16-lane vectors), 24 without, and 24
    where a bfloat16 cache's shared keys take AMX tiles (``AMX_QUERIES`` columns at most, measured no faster
    at 32)."""
    if dtype == torch.bfloat16 and bf16_attention_path(head_dim) == "amx":
        return AMX_TILE_LANES
    return loaded().attention_max_lanes()


def bf16_attention_path(head_dim: int) -> str:
    """What the shared keys of a multi-row tile in a bfloat16 cache run on this CPU: one of ``BF16_ATTENTION_PATHS``."""
    return BF16_ATTENTION_PATHS[loaded().attention_bf16_path(head_dim)]


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles these shapes and dtype: float32, head_dim a multiple of 8, its scratch sizes."""
    return (
        dtype == torch.float32
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and head_dim % 8 == 0
        and block_size <= MAX_BLOCK_SIZE
    )


class AttentionTiles(NamedTuple):
    """Rows of an attention call grouped for the kernel: tile ``t`` is ``rows[starts[t]:starts[t + 1]]``,
    at most ``tile_lanes() // group`` rows whose block tables agree over their first ``shared[t]``
    keys (every row of the tile sees them). A tile of one row has nothing to share."""

    rows: torch.Tensor  # [B] int64, every row once
    starts: torch.Tensor  # [num_tiles + 1] int64
    shared: torch.Tensor  # [num_tiles] int64


def attention(
    q: torch.Tensor,  # [B, Hq, D] float32, any strides: one query token per row
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] float32 or bfloat16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32: each row's table
    seq_lens: torch.Tensor,  # [B] int64: keys each row attends over (a token at position p: p + 1)
    scale: float,
    tiles: AttentionTiles | None = None,  # None: each row alone
    window: int | None = None,
    softcap: float | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an int8 cache's (k_scales, v_scales)
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of one query token per row over the first ``seq_lens`` keys of its table, read in place
    from the paged cache; the rows of a multi-row tile attend over their shared keys together.

    With a ``window`` each row attends over the last ``window`` of its keys only (the blocks before are not
    read); ``softcap`` c turns each scaled score s into ``c * tanh(s / c)``. Tiles then share no keys
    past a row's window, and none at all with a soft cap."""
    lib = loaded()
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not supports(num_heads, num_kv_heads, head_dim, block_size, q.dtype):
        raise ValueError(
            f"unsupported by the CPU kernel: {num_heads} query / {num_kv_heads} KV heads, head_dim {head_dim}, "
            f"block_size {block_size}, {q.dtype}"
        )
    _check_caches(k_cache, v_cache, scales)
    if tiles is None:
        tiles = AttentionTiles(
            torch.arange(num_rows), torch.arange(num_rows + 1), torch.zeros(num_rows, dtype=torch.int64)
        )
    if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
        block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = as_int64(seq_lens)
    out = torch.empty(q.shape)
    kernel = getattr(lib, f"paged_attention_{_SUFFIX[k_cache.dtype]}")
    status = kernel(
        q.data_ptr(), *q.stride(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), num_rows, tiles.rows.data_ptr(), tiles.starts.data_ptr(),
        tiles.shared.data_ptr(), len(tiles.shared), out.data_ptr(), num_heads, num_kv_heads, head_dim, block_size,
        k_cache.shape[0], scale, window or 0, softcap or 0.0,
        *([] if scales is None else [t.data_ptr() for t in scales]),
    )
    if status:
        raise attention_error(status, num_rows, num_heads // num_kv_heads, k_cache.shape[0], block_tables.shape[1])
    return out


def attention_error(status: int, num_rows: int, group: int, num_blocks: int, table_width: int) -> Exception:
    """The error of ``paged_attention``'s status (-1, -2 or -3) for ``num_rows`` rows of ``group`` query heads
    per KV head, ``num_blocks`` cache blocks and tables of ``table_width`` entries."""
    if status == -1:
        return ValueError(
            f"invalid tiles: not every one of the {num_rows} rows in exactly one tile, a tile of more than "
            f"{loaded().attention_max_lanes() // group} rows, or shared keys beyond a row's context or window, where "
            "the rows' tables differ, or with a soft cap"
        )
    if status == -2:
        return IndexError(
            f"a row's context needs a block id outside [0, {num_blocks}) or past its table's {table_width} entries"
        )
    return MemoryError("the CPU attention kernel could not allocate its scratch")


def slot_error(num_slots: int) -> IndexError:
    """The error of ``store_kv``'s status: a slot outside the cache."""
    return IndexError(f"a slot of slot_mapping is outside the cache's {num_slots} slots")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Writes ``k``/``v`` [T, Hkv, D] (float32, any strides) at cache slots ``slot_mapping`` [T] of the
    contiguous caches [num_blocks, block_size, Hkv, D]: float32, bfloat16 (rounded to nearest even) or int8 with
    ``scales`` (k_scales, v_scales) [num_blocks, Hkv]. An int8 block's scale for a head grows to its largest
    |element| / 127 as tokens come (its earlier codes requantized to it) and starts afresh at the block's first
    slot; slots are written in their order."""
    lib = loaded()
    for name, t in (("k", k), ("v", v)):
        check_float32_cpu(name, t)
    _check_caches(k_cache, v_cache, scales)
    k2, v2 = _heads_side_by_side(k), _heads_side_by_side(v)
    slots = as_int64(slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if scales is not None:
        status = lib.store_kv_i8(
            k2.data_ptr(), k2.stride(0), k2.stride(2), v2.data_ptr(), v2.stride(0), v2.stride(2), slots.data_ptr(),
            k2.shape[0], k2.shape[1], k2.shape[2], k_cache.shape[1], k_cache.data_ptr(), v_cache.data_ptr(),
            scales[0].data_ptr(), scales[1].data_ptr(), num_slots,
        )  # fmt: skip
        if status:
            raise slot_error(num_slots)
        return
    kernel = getattr(lib, f"store_kv_{DTYPE_SUFFIX[k_cache.dtype]}")
    status = kernel(k2.data_ptr(), k2.stride(0), k2.stride(2), v2.data_ptr(), v2.stride(0), v2.stride(2),
                    slots.data_ptr(), k2.shape[0], k2.shape[1] * k2.shape[2], k_cache.data_ptr(), v_cache.data_ptr(),
                    num_slots)
    if status:
        raise slot_error(num_slots)


def _check_caches(
    k_cache: torch.Tensor, v_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None
) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _SUFFIX or not t.is_contiguous() or not t.is_cpu:
            raise ValueError(f"{name} must be a contiguous float32, bfloat16 or int8 CPU tensor; got {t.dtype}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype; got {k_cache.dtype} and {v_cache.dtype}")
    if (scales is not None) != (k_cache.dtype == torch.int8):
        raise ValueError("an int8 cache takes its scales (k_scales, v_scales), and only an int8 cache does")
    shape = (k_cache.shape[0], k_cache.shape[2])
    for name, t in zip(("k_scales", "v_scales"), scales, strict=True) if scales is not None else ():
        if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape or not t.is_cpu:
            raise ValueError(
                f"{name} must be a contiguous float32 CPU tensor of shape {shape}; got {t.dtype} {tuple(t.shape)}"
            )


def _heads_side_by_side(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] itself when each token's heads sit side by side (one stride apart), else a contiguous copy."""
    return t if t.stride(1) == t.shape[2] * t.stride(2) else t.contiguous()
