"""KVCacheManager: per-request block tables over a BlockPool, with prefix-block sharing.

The scheduler admits a request with::

    computed = kv.get_computed_blocks(req_id, token_ids, cache_salt)       # pure lookup
    tables = kv.allocate_slots(req_id, token_ids, computed.num_computed_tokens,
                               num_new_tokens, computed=computed, cache_salt=cache_salt)
    if tables is None: ...                                                 # short of blocks

then calls ``allocate_slots(req_id, token_ids, num_computed_tokens, num_new_tokens)``
every step the request runs, and ``free(req_id)`` when it finishes or is preempted.

KV cache groups (``kv_cache_groups``): the model's attention layers are grouped by sliding window
(``sliding_windows``, one entry per group; None = full attention). Each request has one block table
per group, all of the same length, their blocks taken from the one pool: logical block i of group g
holds the K/V of positions ``i * bs .. i * bs + bs - 1`` for that group's layers. A full-attention
group keeps every block; a sliding group of window W releases, as the request advances, the blocks
that lie wholly before ``num_computed_tokens - W + 1`` (the first key the next token's query reads).
A released entry becomes ``NULL_BLOCK``, which no attention kernel reads.

A request's table and hash chain, positions in tokens (a sliding group: released blocks first)::

    0          bs         2bs        3bs     num_slots      3bs+bs
    |  block 0  |  block 1  |  block 2  | block 3 ....:.......|
    |  NULL     |<-- full, hashed ----->|<- partial tail ---->|  never shared
    |<------------- num_cached_blocks = 3 ------------>|

NOTE: token_ids of one req_id are append-only between its admission and its free():
the hash chain is extended, never recomputed, so a decode step costs O(1) unless it
fills a block.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from engine.core.block_hash import (
    BlockHash, ExtraKey, MultiModalSpan, block_image_keys, extend_block_hashes, group_block_hash,
)  # fmt: skip
from engine.core.block_pool import BlockPool, check_invariant
from engine.core.kv_cache_groups import NULL_BLOCK, BlockTables, KVCacheGroups, blocks_per_request

logger = logging.getLogger(__name__)

# Told of each full block as it is registered: its hash and what the hash is computed from (the parent's hash,
# None for a chain's first block; its tokens; the chain's cache salt; its images' keys). Persistence listens.
BlockListener = Callable[[BlockHash, BlockHash | None, Sequence[int], str | None, Sequence[ExtraKey]], None]


class ComputedBlocks(NamedTuple):
    """The cached prefix of a request: each group's blocks and how many tokens they hold."""

    block_ids: BlockTables  # per group; a sliding group's entries before its window are NULL_BLOCK
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of the KV cache's figures; prefix-cache counts are in tokens."""

    num_blocks: int
    num_used_blocks: int  # ref_cnt > 0
    num_cached_blocks: int  # ref_cnt == 0 but hashed: evictable
    num_free_blocks: int  # allocatable now: free + evictable
    prefix_cache_queries: int  # prompt tokens of requests admitted with a lookup
    prefix_cache_hits: int  # of those, tokens found in the cache
    num_evictions: int
    token_utilization: float  # tokens stored / slots of used blocks; 0.0 when none is used

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(slots=True)
class _RequestState:
    tables: BlockTables  # per group: logical block i -> physical block (NULL_BLOCK once released)
    num_released: list[int]  # per group: leading entries of its table that are NULL_BLOCK
    block_hashes: list[BlockHash]  # hash chain of full blocks; may run ahead of the tables
    num_cached_blocks: int  # leading blocks of the tables already offered to the hash index
    num_slots: int  # tokens the tables cover (computed by the end of the last allocated step)
    num_tokens: int  # len(token_ids) at the last allocation
    cache_salt: str | None
    mm_spans: Sequence[MultiModalSpan]  # the request's images, by position: they enter their blocks' hashes


@dataclass(slots=True)
class _Lookup:
    req_id: str
    cache_salt: str | None
    mm_spans: Sequence[MultiModalSpan]
    token_ids: Sequence[int]  # identity-checked: the hashes are reused only for the same list
    block_hashes: list[BlockHash]


class KVCacheManager:
    """Block tables, prefix sharing and LRU eviction of cached blocks; no tensors.

    Args:
        num_blocks: Physical blocks in the KV cache, numbered ``0 .. num_blocks - 1``.
        block_size: Tokens per block.
        enable_prefix_caching: When False, lookups miss and no block is ever hashed.
        sliding_windows: One entry per KV cache group: its layers' sliding window W (a query at
            position p reads keys p - W + 1 .. p), or None for full attention.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        sliding_windows: Sequence[int | None] = (None,),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not sliding_windows or any(w is not None and w < 1 for w in sliding_windows):
            raise ValueError(f"sliding_windows must name >= 1 group, each window >= 1 or None; got {sliding_windows}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_windows = tuple(sliding_windows)
        self._groups = KVCacheGroups(self.sliding_windows, block_size)
        self._sliding_groups = [(g, w) for g, w in enumerate(self.sliding_windows) if w is not None]
        self._no_blocks: BlockTables = tuple([] for _ in self.sliding_windows)  # read only: a miss's tables
        self.block_pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestState] = {}
        self._last_lookup: _Lookup | None = None  # spares an admission its second hashing pass
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self.block_listener: BlockListener | None = None  # persistence sets it to keep the blocks' origins

    @property
    def num_groups(self) -> int:
        return len(self.sliding_windows)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable)."""
        return self.block_pool.num_free_blocks

    def num_blocks_needed(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once (``blocks_per_request``)."""
        return blocks_per_request(self.sliding_windows, self.block_size, num_tokens, max_chunk)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens could ever fit, with the whole pool free."""
        return self.num_blocks_needed(num_tokens) <= self.num_blocks

    def max_num_tokens(self, limit: int, max_chunk: int) -> int:
        """The most tokens (up to ``limit``) one request can reach with the whole pool free, computed in
        steps of at most ``max_chunk`` tokens: without a full-attention group, ``limit`` where its windows fit."""
        low, high = 0, limit  # blocks needed grow with the tokens: the last count that fits
        while low < high:
            mid = (low + high + 1) // 2
            if self.num_blocks_needed(mid, max_chunk) <= self.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    @property
    def has_sliding_groups(self) -> bool:
        """Whether a group releases the blocks behind its window (so a shorter step now needs fewer blocks)."""
        return bool(self._sliding_groups)

    def num_tokens_that_fit(
        self, req_id: str, num_computed_tokens: int, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> int:
        """The most of ``num_new_tokens`` that ``allocate_slots`` (same arguments) can place now: up to the last
        block the free blocks cover in every group, counting those each sliding group releases first (a running
        request's blocks behind its window that no other table holds) and, for a new request, less the
        evictable hit blocks it revives; 0 when not one more block fits."""
        pool = self.block_pool
        state = self._requests.get(req_id)
        if state is not None:
            num_blocks = len(state.tables[0])
            available = pool.num_free_blocks
            for group, window in self._sliding_groups:
                table = state.tables[group]
                stop = min(max(num_computed_tokens - window + 1, 0) // self.block_size, len(table))
                available += sum(pool.blocks[i].ref_cnt == 1 for i in table[state.num_released[group] : stop])
        else:
            tables = computed.block_ids if computed is not None else self._no_blocks
            num_blocks = num_computed_tokens // self.block_size
            revived = sum(pool.blocks[i].ref_cnt == 0 for table in tables for i in table if i != NULL_BLOCK)
            available = pool.num_free_blocks - revived
        most = (num_blocks + max(available, 0) // self.num_groups) * self.block_size - num_computed_tokens
        return max(min(num_new_tokens, most), 0)

    def get_computed_blocks(
        self, req_id: str, token_ids: Sequence[int], cache_salt: str | None = None,
        mm_spans: Sequence[MultiModalSpan] = (),
    ) -> ComputedBlocks:
        """Finds the longest prefix of ``token_ids`` whose blocks every group has cached.

        A full-attention group needs every block of the prefix; a sliding group only those
        its window reaches from the prefix's end (the first token computed next reads them).
        A pure lookup: takes no reference, so an allocation in between may evict the
        blocks found; call ``allocate_slots`` right after.

        NOTE: at least one token is left to compute (the model needs the last token's
        logits), so a prompt of exactly k full blocks hits at most k - 1 of them.

        Args:
            req_id: The request, new to the manager.
            token_ids: The request's tokens (prompt, plus output when readmitted).
            cache_salt: Isolates the request's blocks from other salts' (tenant, adapter).
            mm_spans: The request's images: a block holding an image's tokens hits only for the same image.

        Returns:
            Each group's hit blocks and the number of tokens they hold.
        """
        if not self.enable_prefix_caching:
            return ComputedBlocks(tuple([] for _ in self.sliding_windows), 0)
        lookup = self._last_lookup
        if lookup is None or not (
            lookup.req_id == req_id and lookup.cache_salt == cache_salt and lookup.token_ids is token_ids
            and lookup.mm_spans == mm_spans
        ):
            lookup = self._last_lookup = _Lookup(req_id, cache_salt, mm_spans, token_ids, [])
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        extend_block_hashes(
            lookup.block_hashes, token_ids, max_blocks * self.block_size, self.block_size, cache_salt, mm_spans
        )
        hashes, get_cached_block = lookup.block_hashes, self.block_pool.get_cached_block

        def cached(group: int, i: int) -> int | None:
            block = get_cached_block(hashes[i] if group == 0 else group_block_hash(hashes[i], group))
            return None if block is None else block.block_id

        num_hit = self._groups.longest_prefix(max_blocks, lambda g, i: cached(g, i) is not None)
        tables = self._groups.hit_tables(num_hit, cached)
        logger.debug("lookup %s: %d of %d full blocks cached", req_id, num_hit, max_blocks)
        return ComputedBlocks(tables, num_hit * self.block_size)

    def allocate_slots(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
        cache_salt: str | None = None,
        mm_spans: Sequence[MultiModalSpan] = (),
    ) -> BlockTables | None:
        """Grows the request's tables to cover ``num_computed_tokens + num_new_tokens`` slots.

        A new request first takes a reference on its ``computed`` blocks (reviving
        evictable ones). A running one first releases, in each sliding group, the blocks
        its window has left behind (they stay cached, evictable, under their hash). Then
        full blocks whose tokens are all known and computed by the end of this step are
        registered under their hash, so a request admitted later in the same step shares them.

        NOTE: a block is registered only once its last slot is scheduled: a prefill
        chunk that ends mid-block leaves that block unshared until the next chunk.

        Args:
            req_id: The request.
            token_ids: All its known tokens (append-only across calls).
            num_computed_tokens: Tokens already in the cache (for a new request: the hits).
            num_new_tokens: Tokens to compute this step.
            computed: A new request's hit, from ``get_computed_blocks``; counts the
                admission in the prefix-cache figures.
            cache_salt, mm_spans: As given to ``get_computed_blocks``.

        Returns:
            Every group's whole block table, or None when the pool is short: then nothing
            is allocated (blocks out of the window may have been released).

        Raises:
            ValueError: On negative counts, or ``computed`` that does not match
                ``num_computed_tokens``, is stale, or is given for a running request.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"token counts must be >= 0; got {num_computed_tokens}, {num_new_tokens}")
        num_slots = num_computed_tokens + num_new_tokens
        state = self._requests.get(req_id)
        if state is not None:
            if computed is not None and any(computed.block_ids):
                raise ValueError(f"request {req_id} already holds blocks; computed is for admission only")
            if self._sliding_groups:
                self._release_out_of_window(state, num_computed_tokens)
            return self._grow(req_id, state, token_ids, num_slots)
        computed_tables = computed.block_ids if computed is not None else self._no_blocks
        num_hit = num_computed_tokens // self.block_size
        if len(computed_tables) != self.num_groups or any(
            len(table) * self.block_size != num_computed_tokens for table in computed_tables
        ):
            raise ValueError(
                f"new request {req_id}: num_computed_tokens {num_computed_tokens} != computed blocks "
                f"{[len(t) for t in computed_tables]} (one table per group of {self.num_groups}) x {self.block_size}"
            )
        block_hashes = self._lookup_hashes(req_id, token_ids, cache_salt, mm_spans)
        self._check_computed(req_id, computed_tables, block_hashes, token_ids, cache_salt, mm_spans)
        pool = self.block_pool
        hit_ids = [i for table in computed_tables for i in table if i != NULL_BLOCK]
        num_needed = max(-(-num_slots // self.block_size) - num_hit, 0) * self.num_groups
        num_revived = sum(pool.blocks[i].ref_cnt == 0 for i in hit_ids)
        if num_needed + num_revived > pool.num_free_blocks:
            logger.debug("allocate %s: short of blocks (need %d, %d free)", req_id, num_needed + num_revived,
                         pool.num_free_blocks)
            return None
        pool.touch(hit_ids)
        tables = tuple(list(table) for table in computed_tables)
        num_released = [table.count(NULL_BLOCK) for table in tables]
        state = self._requests[req_id] = _RequestState(
            tables, num_released, block_hashes, num_hit, 0, 0, cache_salt, mm_spans
        )
        self._last_lookup = None
        if computed is not None:
            self._prefix_cache_queries += len(token_ids)
            self._prefix_cache_hits += num_computed_tokens
        return self._grow(req_id, state, token_ids, num_slots)  # NOTE: cannot fail: blocks counted above

    def free(self, req_id: str) -> None:
        """Drops the request's references, tail block first; unknown ids are a no-op.

        Unreferenced hashed blocks stay cached in the LRU, tail first (each position's
        blocks of every group together), so a prompt's tail is evicted before its head
        (the head is what other prompts share).
        """
        if self._last_lookup is not None and self._last_lookup.req_id == req_id:
            self._last_lookup = None
        state = self._requests.pop(req_id, None)
        if state is None:
            return
        tables = state.tables
        if len(tables) == 1:
            held = tables[0][state.num_released[0] :]
            held.reverse()
        else:
            held = [table[i] for i in reversed(range(len(tables[0]))) for table in tables if table[i] != NULL_BLOCK]
        self.block_pool.free_blocks(held)
        logger.debug("free %s: %d blocks", req_id, len(held))

    def free_tail(self, req_id: str, num_tokens: int) -> None:
        """Shrinks the request's tables to their first ``num_tokens`` slots (rejected draft tokens
        leave), freeing the blocks past them.

        NOTE: only unhashed blocks can go: a block is hashed once its tokens are the request's
        own, and draft tokens are not until accepted.

        Raises:
            KeyError: The request holds no blocks.
            ValueError: ``num_tokens`` would drop a hashed block.
        """
        state = self._requests[req_id]
        num_kept = -(-num_tokens // self.block_size)
        if num_kept < state.num_cached_blocks:
            raise ValueError(f"free_tail {req_id}: {num_tokens} tokens would drop hashed blocks")
        tail = []
        for table in state.tables:
            tail += [block for block in reversed(table[num_kept:]) if block != NULL_BLOCK]
            del table[num_kept:]
        state.num_slots = min(state.num_slots, num_tokens)
        self.block_pool.free_blocks(tail)
        logger.debug("free_tail %s: %d tokens, %d blocks freed", req_id, num_tokens, len(tail))

    def fork(self, parent_req_id: str, child_req_id: str) -> int:
        """Gives a new child request the parent's computed full blocks (+1 reference each).

        The child's partial tail, and at least its last token, are recomputed by the child;
        in a sliding group, the child's window must find its blocks in the parent's table,
        else the child shares fewer blocks (none, at worst).

        Returns:
            The child's num_computed_tokens.

        Raises:
            KeyError: The parent holds no blocks.
            ValueError: The child already exists.
        """
        parent = self._requests.get(parent_req_id)
        if parent is None:
            raise KeyError(f"fork: unknown parent request {parent_req_id!r}")
        if child_req_id in self._requests:
            raise ValueError(f"fork: child request {child_req_id!r} already exists")
        most = max(min(parent.num_slots, parent.num_tokens - 1), 0) // self.block_size
        num_shared = self._groups.longest_prefix(most, lambda g, i: parent.tables[g][i] != NULL_BLOCK)
        tables = self._groups.hit_tables(num_shared, lambda g, i: parent.tables[g][i])
        self.block_pool.touch(i for table in tables for i in table if i != NULL_BLOCK)
        num_computed = num_shared * self.block_size
        self._requests[child_req_id] = _RequestState(
            tables, [table.count(NULL_BLOCK) for table in tables], parent.block_hashes[:num_shared], num_shared,
            num_computed, parent.num_tokens, parent.cache_salt, parent.mm_spans,
        )
        logger.debug("fork %s -> %s: %d shared blocks", parent_req_id, child_req_id, num_shared)
        return num_computed

    def restore_cached_block(self, block_hash: BlockHash) -> int | None:
        """Registers a block read back from disk as cached: unreferenced, evictable, its hash indexed.

        The caller writes the block's K/V before the next lookup. Restored blocks are evicted
        before any other cached block, a chain's last block first.

        Returns:
            The block's id; None when the pool has no free block or the hash is cached already.
        """
        block = self.block_pool.restore_cached_block(block_hash)
        return None if block is None else block.block_id

    def evict_restored_blocks(self, block_ids: list[int]) -> None:
        """Undoes ``restore_cached_block`` for blocks whose K/V could not be written: free again, no hit."""
        self.block_pool.evict_cached_blocks(block_ids)

    def cached_block_hashes(self, req_id: str) -> list[BlockHash]:
        """The hashes of the request's registered full blocks, first to last (none for a request without blocks)."""
        state = self._requests.get(req_id)
        return [] if state is None else state.block_hashes[: state.num_cached_blocks]

    def reset_prefix_cache(self) -> None:
        """Forgets the hashes of every unreferenced block (their content may be unwritten)."""
        num_dropped = self.block_pool.reset_prefix_cache()
        logger.debug("reset prefix cache: %d cached blocks dropped", num_dropped)

    @property
    def req_ids(self) -> list[str]:
        """The requests that hold block tables (running, or pinned prefixes)."""
        return list(self._requests)

    def get_block_ids(self, req_id: str) -> BlockTables:
        """Returns a copy of the request's block tables, one per group.

        Raises:
            KeyError: The request holds no blocks.
        """
        return tuple(list(table) for table in self._requests[req_id].tables)

    def stats(self) -> KVCacheStats:
        """Returns the current figures (O(number of requests))."""
        pool = self.block_pool
        num_used = pool.num_used_blocks
        # NOTE: only a table's last block can be partial, and it is never shared nor released.
        num_empty = sum(
            (len(s.tables[0]) * self.block_size - s.num_slots) * self.num_groups for s in self._requests.values()
        )
        num_used_slots = num_used * self.block_size
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_used_blocks=num_used,
            num_cached_blocks=pool.num_cached_blocks,
            num_free_blocks=pool.num_free_blocks,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
            num_evictions=pool.num_evictions,
            token_utilization=(num_used_slots - num_empty) / num_used_slots if num_used_slots else 0.0,
        )

    def check_integrity(self) -> None:
        """Checks the pool, and that each block's ref_cnt equals the number of tables holding it.

        Raises:
            AssertionError: Naming the first broken invariant.
        """
        self.block_pool.check_integrity()
        holders: Counter[int] = Counter()
        for req_id, state in self._requests.items():
            check_invariant(len(state.tables) == self.num_groups, f"request {req_id} has a table per group")
            num_entries = len(state.tables[0])
            check_invariant(num_entries * self.block_size >= state.num_slots, f"request {req_id}'s tables are short")
            check_invariant(state.num_cached_blocks <= num_entries, f"request {req_id} cached blocks beyond its table")
            for group, (table, window) in enumerate(zip(state.tables, self.sliding_windows)):
                released = state.num_released[group]
                held = table[released:]
                check_invariant(len(table) == num_entries, f"request {req_id}'s tables differ in length")
                check_invariant(table[:released] == [NULL_BLOCK] * released and NULL_BLOCK not in held,
                                f"request {req_id}'s group {group} table is not NULL_BLOCK up to {released} only")
                check_invariant(window is not None or released == 0, f"full-attention group {group} released blocks")
                check_invariant(len(set(held)) == len(held), f"request {req_id}'s table holds a block twice")
                holders.update(held)
                for i in range(released, state.num_cached_blocks):
                    block_hash = self.block_pool.blocks[table[i]].block_hash
                    check_invariant(
                        block_hash is None or block_hash == group_block_hash(state.block_hashes[i], group),
                        f"request {req_id}'s block {table[i]} carries another chain's hash",
                    )
        for block in self.block_pool.blocks:
            check_invariant(
                block.ref_cnt == holders[block.block_id],
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but {holders[block.block_id]} tables hold it",
            )

    def _lookup_hashes(
        self, req_id: str, token_ids: Sequence[int], cache_salt: str | None, mm_spans: Sequence[MultiModalSpan]
    ) -> list[BlockHash]:
        lookup = self._last_lookup
        if lookup is not None and (lookup.req_id, lookup.cache_salt, lookup.mm_spans) == (req_id, cache_salt, mm_spans):
            if lookup.token_ids is token_ids:
                return lookup.block_hashes
        return []

    def _check_computed(
        self,
        req_id: str,
        computed: BlockTables,
        block_hashes: list[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None,
        mm_spans: Sequence[MultiModalSpan],
    ) -> None:
        num_hit = len(computed[0])
        if not num_hit:
            return
        if not self.enable_prefix_caching:
            raise ValueError(f"request {req_id}: computed blocks given with prefix caching off")
        extend_block_hashes(block_hashes, token_ids, num_hit * self.block_size, self.block_size, cache_salt, mm_spans)
        for group, table in enumerate(computed):
            first = self._groups.first_needed(group, num_hit * self.block_size)
            for i, block_id in enumerate(table):
                if i < first:
                    stale = block_id != NULL_BLOCK  # blocks before the window are not taken
                else:
                    expected = group_block_hash(block_hashes[i], group) if i < len(block_hashes) else None
                    stale = block_id == NULL_BLOCK or self.block_pool.blocks[block_id].block_hash != expected
                if stale:
                    raise ValueError(
                        f"request {req_id}: computed block {block_id} no longer holds its prefix "
                        "(evicted since get_computed_blocks?)"
                    )

    def _release_out_of_window(self, state: _RequestState, num_computed: int) -> None:
        """Releases, in each sliding group, the blocks no query from position ``num_computed`` on reads."""
        for group, window in self._sliding_groups:
            table, start = state.tables[group], state.num_released[group]
            stop = min(max(num_computed - window + 1, 0) // self.block_size, len(table))
            if stop <= start:
                continue
            # NOTE: oldest first into the LRU: a later prefix hit needs the blocks of its window, not the head
            self.block_pool.free_blocks(table[start:stop])
            table[start:stop] = [NULL_BLOCK] * (stop - start)
            state.num_released[group] = stop

    def _grow(self, req_id: str, state: _RequestState, token_ids: Sequence[int], num_slots: int) -> BlockTables | None:
        tables = state.tables
        num_new = -(-num_slots // self.block_size) - len(tables[0])
        if num_new > 0:
            num_needed = num_new * self.num_groups
            if num_needed > self.block_pool.num_free_blocks:
                logger.debug("allocate %s: short of blocks (need %d, %d free)", req_id, num_needed,
                             self.block_pool.num_free_blocks)
                return None
            new_ids = [block.block_id for block in self.block_pool.get_new_blocks(num_needed)]
            for group, table in enumerate(tables):
                table.extend(new_ids[group * num_new : (group + 1) * num_new])
            logger.debug("allocate %s: %d new blocks, tables %s", req_id, num_needed, tables)
        if num_slots > state.num_slots:
            state.num_slots = num_slots
        state.num_tokens = len(token_ids)
        if self.enable_prefix_caching:
            self._cache_full_blocks(state, token_ids)
        return tuple(map(list, tables))

    def _cache_full_blocks(self, state: _RequestState, token_ids: Sequence[int]) -> None:
        num_full = min(state.num_slots, len(token_ids)) // self.block_size
        if num_full <= state.num_cached_blocks:
            return
        extend_block_hashes(state.block_hashes, token_ids, num_full * self.block_size, self.block_size,
                            state.cache_salt, state.mm_spans)
        pool, hashes, listener = self.block_pool, state.block_hashes, self.block_listener
        for group, table in enumerate(state.tables):
            for i in range(max(state.num_cached_blocks, state.num_released[group]), num_full):
                key = hashes[i] if group == 0 else group_block_hash(hashes[i], group)
                if pool.cache_full_block(pool.blocks[table[i]], key) and listener is not None and group == 0:
                    start = i * self.block_size
                    images = block_image_keys(state.mm_spans, start, self.block_size) if state.mm_spans else ()
                    listener(hashes[i], hashes[i - 1] if i else None, token_ids[start : start + self.block_size],
                             state.cache_salt, images)
        state.num_cached_blocks = num_full
