"""BlockPool: free list order, ref counts, hash index, LRU eviction, revival, integrity checks."""

from __future__ import annotations

import pytest

from engine.core.block_hash import hash_block_tokens
from engine.core.block_pool import BlockPool


def _h(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def test_new_blocks_come_from_the_free_list_in_order() -> None:
    """A fresh pool hands out blocks 0, 1, 2, ... with ref_cnt 1."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (1, 3, 0)
    pool.check_integrity()


def test_unhashed_freed_blocks_return_to_the_free_list_tail() -> None:
    """Freed unhashed blocks queue behind never-used ones (FIFO)."""
    pool = BlockPool(4)
    pool.get_new_blocks(2)
    pool.free_blocks([1, 0])
    assert list(pool.free_block_ids) == [2, 3, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [2, 3, 1, 0]
    pool.check_integrity()


def test_shared_block_is_freed_only_when_the_last_reference_goes() -> None:
    """touch adds references; a block returns to the pool at ref_cnt 0 only."""
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([0])
    pool.free_blocks([0])
    assert block.ref_cnt == 1 and 0 not in pool.free_block_ids
    pool.free_blocks([0])
    assert block.ref_cnt == 0 and list(pool.free_block_ids) == [1, 0]
    pool.check_integrity()


def test_hashed_blocks_become_evictable_and_are_evicted_lru_after_free_ones() -> None:
    """Allocation drains free blocks first, then evicts cached blocks oldest-freed first."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    for b in blocks:
        assert pool.cache_full_block(b, _h(b.block_id))
    pool.free_blocks([2, 0, 1])  # LRU order: 2, 0, 1
    assert list(pool.evictable) == [2, 0, 1]
    assert (pool.num_free_blocks, pool.num_cached_blocks) == (4, 3)
    taken = pool.get_new_blocks(3)
    assert [b.block_id for b in taken] == [3, 2, 0]
    assert pool.num_evictions == 2
    assert pool.get_cached_block(_h(2)) is None and pool.get_cached_block(_h(0)) is None
    assert pool.get_cached_block(_h(1)) is pool.blocks[1]
    assert taken[1].block_hash is None
    pool.check_integrity()


def test_touch_revives_an_evictable_block() -> None:
    """A hit on an evictable block removes it from the LRU, so pressure cannot evict it."""
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, _h(7))
    pool.free_blocks([0])
    pool.touch([0])
    assert block.ref_cnt == 1 and not pool.evictable
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert pool.get_cached_block(_h(7)) is block
    pool.check_integrity()


def test_duplicate_hash_is_not_registered_twice() -> None:
    """Two blocks computed with the same content: the index keeps the first, the second stays unhashed."""
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, _h(1))
    assert not pool.cache_full_block(b, _h(1))
    assert not pool.cache_full_block(a, _h(2))  # a block is registered once
    assert b.block_hash is None and pool.get_cached_block(_h(1)) is a
    pool.free_blocks([1, 0])
    assert list(pool.free_block_ids) == [2, 1] and list(pool.evictable) == [0]
    pool.check_integrity()


def test_asking_for_too_many_blocks_raises_and_changes_nothing() -> None:
    """get_new_blocks beyond free + evictable is a caller bug: ValueError, pool untouched."""
    pool = BlockPool(2)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert list(pool.free_block_ids) == [1]
    pool.check_integrity()


def test_reset_prefix_cache_drops_only_unreferenced_hashes() -> None:
    """Evictable blocks become free and forget their hash; held blocks keep theirs."""
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, _h(1))
    pool.cache_full_block(b, _h(2))
    pool.free_blocks([0])
    assert pool.reset_prefix_cache() == 1
    assert a.block_hash is None and pool.get_cached_block(_h(1)) is None
    assert pool.get_cached_block(_h(2)) is b
    assert list(pool.free_block_ids) == [2, 0] and not pool.evictable
    pool.check_integrity()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: p.free_block_ids.append(1), "twice in the free list"),
        (lambda p: setattr(p.blocks[1], "ref_cnt", -1), "ref_cnt -1 < 0"),
        (lambda p: setattr(p.blocks[2], "ref_cnt", 1), "used block 2 is in a free list"),
        (lambda p: setattr(p.blocks[0], "block_hash", _h(9)), "block 0's hash is indexed to block None"),
        (lambda p: p.free_block_ids.remove(2), "not in the free list"),
        (lambda p: p.cached_block_hash_to_id.__setitem__(_h(5), 2), "hashes no block carries"),
    ],
)
def test_check_integrity_names_the_broken_invariant(corrupt, message) -> None:  # type: ignore[no-untyped-def]
    """Each kind of corruption raises AssertionError with a message that names it."""
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_pool_needs_a_block() -> None:
    """An empty pool is a configuration error."""
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
