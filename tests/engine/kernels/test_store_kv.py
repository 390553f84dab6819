"""The KV-store kernel against a torch scatter."""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_batch, stored_cache

from engine.kernels import store_kv


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(16, 2, 32), (8, 3, 24), (32, 1, 64)])
def test_store_writes_exact_rows_at_slots(dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int) -> None:
    """Every new row lands bit-exactly at its slot, across blocks; no other cache row changes."""
    b = make_batch(
        [(21, 21), (40, 7), (9, 1)],
        num_q_heads=num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    expected = stored_cache(b)
    store_kv(b.k, b.v, b.kv_cache[0], b.kv_cache[1], b.meta.slot_mapping)
    assert _same(b.kv_cache, expected)


def test_negative_slot_is_skipped() -> None:
    """A padding token (slot -1) writes nothing; the real tokens around it are stored."""
    b = make_batch([(5, 5)], num_q_heads=2)
    slots = b.meta.slot_mapping.clone()
    slots[2] = -1
    expected = b.kv_cache.clone()
    flat = expected.view(2, -1, *expected.shape[3:])
    keep = slots >= 0
    flat[0, slots[keep]] = b.k[keep]
    flat[1, slots[keep]] = b.v[keep]
    store_kv(b.k, b.v, b.kv_cache[0], b.kv_cache[1], slots)
    assert _same(b.kv_cache, expected)


def test_store_accepts_strided_key_value() -> None:
    """K/V sliced out of a fused QKV projection (token stride != Hkv * D) are stored correctly."""
    b = make_batch([(12, 12)], num_q_heads=2)
    fused = torch.cat([b.k, b.v], dim=1)  # [T, 2 * Hkv, D]
    k, v = fused[:, :2], fused[:, 2:]
    expected = stored_cache(b)
    store_kv(k, v, b.kv_cache[0], b.kv_cache[1], b.meta.slot_mapping)
    assert _same(b.kv_cache, expected)


def test_store_rejects_mismatched_inputs() -> None:
    """Wrong head count, dtype or slot count fail before launch with a message naming the input."""
    b = make_batch([(4, 4)], num_q_heads=2)
    kc, vc = b.kv_cache[0], b.kv_cache[1]
    with pytest.raises(ValueError, match="key/value must be"):
        store_kv(b.k[:, :1], b.v[:, :1], kc, vc, b.meta.slot_mapping)
    with pytest.raises(TypeError, match="key must have dtype"):
        store_kv(b.k.half(), b.v.half(), kc, vc, b.meta.slot_mapping)
    with pytest.raises(ValueError, match="slot_mapping has 3 entries"):
        store_kv(b.k, b.v, kc, vc, b.meta.slot_mapping[:3])
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        cache = torch.zeros(2, 4, 6, 2, 32)
        store_kv(b.k, b.v, cache[0], cache[1], b.meta.slot_mapping)
