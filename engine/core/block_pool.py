"""BlockPool: the fixed set of KV blocks, their ref counts, and the prefix-hash index.

Every block is in exactly one of three states::

    free       ref_cnt == 0, no hash        in free_block_ids (FIFO)
    used       ref_cnt  > 0, hash or not    in no list; held by ref_cnt block tables
    cached     ref_cnt == 0, hashed         in the evictable LRU (oldest first)

Allocation takes free blocks first, then evicts the least recently freed cached
block (dropping its hash). ``touch`` revives a cached block a new request hits.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterable

from engine.core.block_hash import BlockHash

# NOTE: the whole KV cache (pool and manager) logs under one documented logger name.
logger = logging.getLogger("engine.core.kv_cache_manager")


class KVCacheBlock:
    """One physical block: its id, how many block tables hold it, and its prefix hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set only while the block is full and registered

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={digest})"


class BlockPool:
    """Owns ``num_blocks`` blocks: free list, ref counts, hash index and evictable LRU.

    All operations are O(1) per block. The pool knows nothing of requests; the
    ``KVCacheManager`` owns block tables and calls the pool.

    Args:
        num_blocks: Number of physical blocks, numbered ``0 .. num_blocks - 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        # NOTE: insertion order is eviction order: the first entry is evicted first.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cached_block_hash_to_id: dict[BlockHash, int] = {}
        # Running totals (the step log reports their change per step): blocks taken by
        # get_new_blocks, blocks whose last reference free_blocks dropped, cached blocks evicted.
        self.num_allocated = 0
        self.num_freed = 0
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that keep their hash (evictable)."""
        return len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref_cnt > 0."""
        return self.num_blocks - self.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Returns the block registered under ``block_hash``, used or evictable, if any."""
        block_id = self.cached_block_hash_to_id.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes ``num_blocks`` blocks with ref_cnt 1: free ones first, then LRU evictions.

        Raises:
            ValueError: When fewer than ``num_blocks`` blocks are free or evictable;
                the caller checks ``num_free_blocks`` first, so this is a bug.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot take {num_blocks} blocks; {self.num_free_blocks} free")
        num_from_free = min(num_blocks, len(self.free_block_ids))
        taken = [self.blocks[self.free_block_ids.popleft()] for _ in range(num_from_free)]
        if num_from_free < num_blocks:
            evicted = [self.blocks[self.evictable.popitem(last=False)[0]] for _ in range(num_blocks - num_from_free)]
            for block in evicted:
                self._drop_hash(block)
            self.num_evictions += len(evicted)
            if logger.isEnabledFor(logging.DEBUG):
                ids = [block.block_id for block in evicted]
                logger.debug("evict %d cached blocks, least recently used first: %s", len(ids), ids)
            taken += evicted
        for block in taken:
            block.ref_cnt = 1
        self.num_allocated += num_blocks
        return taken

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes one more reference on each block, reviving evictable ones."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.evictable[block_id]
            block.ref_cnt += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drops one reference on each block, in order; unreferenced blocks become free or cached.

        NOTE: blocks reach the LRU in the order given, so the first given is evicted
        first; the manager passes a table tail first.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.num_freed += 1
                if block.block_hash is None:
                    self.free_block_ids.append(block_id)
                else:
                    self.evictable[block_id] = None

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Registers a used, full block under ``block_hash``.

        Returns:
            False, leaving the block unhashed, when another block already holds that
            hash (both were computed before either was registered); True otherwise.
        """
        if block.block_hash is not None or block_hash in self.cached_block_hash_to_id:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_id[block_hash] = block.block_id
        return True

    def restore_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Takes a free block and makes it cached under ``block_hash``: unreferenced, first to evict.

        For KV read back from disk: the caller writes the block's content before any lookup.

        Returns:
            The block; None when no block is free (cached ones are not evicted for it) or the
            hash is indexed already.
        """
        if block_hash in self.cached_block_hash_to_id or not self.free_block_ids:
            return None
        block = self.blocks[self.free_block_ids.popleft()]
        block.block_hash = block_hash
        self.cached_block_hash_to_id[block_hash] = block.block_id
        self.evictable[block.block_id] = None
        self.evictable.move_to_end(block.block_id, last=False)
        return block

    def evict_cached_blocks(self, block_ids: Iterable[int]) -> None:
        """Makes unreferenced cached blocks free now, their hashes dropped (restored blocks whose K/V did not load).

        Raises:
            ValueError: a block is referenced or not cached.
        """
        for block_id in block_ids:
            if block_id not in self.evictable:
                raise ValueError(f"block {block_id} is not an unreferenced cached block")
            del self.evictable[block_id]
            self._drop_hash(self.blocks[block_id])
            self.free_block_ids.append(block_id)

    def reset_prefix_cache(self) -> int:
        """Forgets the hashes of all unreferenced blocks; returns how many were dropped."""
        num_dropped = len(self.evictable)
        while self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            self._drop_hash(self.blocks[block_id])
            self.free_block_ids.append(block_id)
        return num_dropped

    def check_integrity(self) -> None:
        """Checks that every block is in exactly one state and the hash index agrees.

        Raises:
            AssertionError: Naming the first broken invariant.
        """
        free = set(self.free_block_ids)
        check_invariant(len(free) == len(self.free_block_ids), "a block id appears twice in the free list")
        check_invariant(not free & self.evictable.keys(), f"blocks both free and evictable: {free & self.evictable.keys()}")
        num_used = 0
        for block in self.blocks:
            bid = block.block_id
            check_invariant(block.ref_cnt >= 0, f"block {bid} has ref_cnt {block.ref_cnt} < 0")
            if block.ref_cnt > 0:
                num_used += 1
                check_invariant(bid not in free and bid not in self.evictable, f"used block {bid} is in a free list")
            elif block.block_hash is None:
                check_invariant(bid in free, f"unreferenced unhashed block {bid} is not in the free list")
            else:
                check_invariant(bid in self.evictable, f"unreferenced hashed block {bid} is not evictable")
            if block.block_hash is not None:
                owner = self.cached_block_hash_to_id.get(block.block_hash)
                check_invariant(owner == bid, f"block {bid}'s hash is indexed to block {owner}")
        check_invariant(
            len(self.cached_block_hash_to_id) == sum(b.block_hash is not None for b in self.blocks),
            "the hash index holds hashes no block carries",
        )
        check_invariant(
            len(free) + len(self.evictable) + num_used == self.num_blocks,
            f"free {len(free)} + cached {len(self.evictable)} + used {num_used} != {self.num_blocks}",
        )

    def _drop_hash(self, block: KVCacheBlock) -> None:
        del self.cached_block_hash_to_id[block.block_hash]  # type: ignore[arg-type]
        block.block_hash = None


def check_invariant(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"KV cache integrity: {message}")
