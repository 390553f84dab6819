"""KVCacheManager: per-request block tables over a BlockPool, with prefix-block sharing.

The scheduler admits a request with::

    computed = kv.get_computed_blocks(req_id, token_ids, cache_salt)       # pure lookup
    block_ids = kv.allocate_slots(req_id, token_ids, computed.num_computed_tokens,
                                  num_new_tokens, computed=computed, cache_salt=cache_salt)
    if block_ids is None: ...                                              # short of blocks

then calls ``allocate_slots(req_id, token_ids, num_computed_tokens, num_new_tokens)``
every step the request runs, and ``free(req_id)`` when it finishes or is preempted.

A request's table and hash chain, positions in tokens::

    0          bs         2bs        3bs     num_slots      3bs+bs
    |  block 0  |  block 1  |  block 2  | block 3 ....:.......|
    |<------ full, hashed, shareable -->|<- partial tail ---->|  never shared
    |<------------- num_cached_blocks = 3 ------------>|

NOTE: token_ids of one req_id are append-only between its admission and its free():
the hash chain is extended, never recomputed, so a decode step costs O(1) unless it
fills a block.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from engine.core.block_hash import BlockHash, extend_block_hashes
from engine.core.block_pool import BlockPool, check_invariant

logger = logging.getLogger(__name__)


class BlockOrigin(NamedTuple):
    """What a full block's hash is computed from: enough to recompute it, so to persist the block."""

    parent_hash: BlockHash | None  # None for a chain's first block
    token_ids: tuple[int, ...]
    cache_salt: str | None  # the chain's salt (it enters the first block's hash only)


class ComputedBlocks(NamedTuple):
    """The cached prefix of a request: its blocks and how many tokens they hold."""

    block_ids: list[int]
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
    block_ids: list[int]  # the block table: logical block i -> physical block
    block_hashes: list[BlockHash]  # hash chain of full blocks; may run ahead of block_ids
    num_cached_blocks: int  # leading blocks of the table already offered to the hash index
    num_slots: int  # tokens the table covers (computed by the end of the last allocated step)
    num_tokens: int  # len(token_ids) at the last allocation
    cache_salt: str | None


@dataclass(slots=True)
class _Lookup:
    req_id: str
    cache_salt: str | None
    token_ids: Sequence[int]  # identity-checked: the hashes are reused only for the same list
    block_hashes: list[BlockHash]


class KVCacheManager:
    """Block tables, prefix sharing and LRU eviction of cached blocks; no tensors.

    Args:
        num_blocks: Physical blocks in the KV cache, numbered ``0 .. num_blocks - 1``.
        block_size: Tokens per block.
        enable_prefix_caching: When False, lookups miss and no block is ever hashed.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestState] = {}
        self._last_lookup: _Lookup | None = None  # spares an admission its second hashing pass
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        # NOTE: None until track_block_origins(); then every registered hash's origin (pruned to the hash index).
        self.block_origins: dict[BlockHash, BlockOrigin] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable)."""
        return self.block_pool.num_free_blocks

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens could ever fit, with the whole pool free."""
        return -(-num_tokens // self.block_size) <= self.num_blocks

    def get_computed_blocks(
        self, req_id: str, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> ComputedBlocks:
        """Finds the longest chain of cached full blocks that prefixes ``token_ids``.

        A pure lookup: takes no reference, so an allocation in between may evict the
        blocks found; call ``allocate_slots`` right after.

        NOTE: at least one token is left to compute (the model needs the last token's
        logits), so a prompt of exactly k full blocks hits at most k - 1 of them.

        Args:
            req_id: The request, new to the manager.
            token_ids: The request's tokens (prompt, plus output when readmitted).
            cache_salt: Isolates the request's blocks from other salts' (tenant, adapter).

        Returns:
            The hit block ids and the number of tokens they hold.
        """
        if not self.enable_prefix_caching:
            return ComputedBlocks([], 0)
        lookup = self._last_lookup
        if lookup is None or not (
            lookup.req_id == req_id and lookup.cache_salt == cache_salt and lookup.token_ids is token_ids
        ):
            lookup = self._last_lookup = _Lookup(req_id, cache_salt, token_ids, [])
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        extend_block_hashes(lookup.block_hashes, token_ids, max_blocks * self.block_size, self.block_size, cache_salt)
        block_ids = []
        for block_hash in lookup.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            block_ids.append(block.block_id)
        logger.debug("lookup %s: %d of %d full blocks cached", req_id, len(block_ids), max_blocks)
        return ComputedBlocks(block_ids, len(block_ids) * self.block_size)

    def allocate_slots(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        computed: ComputedBlocks | Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[int] | None:
        """Grows the request's table to cover ``num_computed_tokens + num_new_tokens`` slots.

        A new request first takes a reference on its ``computed`` blocks (reviving
        evictable ones). Then full blocks whose tokens are all known and computed by
        the end of this step are registered under their hash, so a request admitted
        later in the same step shares them.

        NOTE: a block is registered only once its last slot is scheduled: a prefill
        chunk that ends mid-block leaves that block unshared until the next chunk.

        Args:
            req_id: The request.
            token_ids: All its known tokens (append-only across calls).
            num_computed_tokens: Tokens already in the cache (for a new request: the hits).
            num_new_tokens: Tokens to compute this step.
            computed: A new request's hit, from ``get_computed_blocks``; counts the
                admission in the prefix-cache figures.
            cache_salt: As given to ``get_computed_blocks``.

        Returns:
            The whole block table, or None with nothing changed when the pool is short.

        Raises:
            ValueError: On negative counts, or ``computed`` that does not match
                ``num_computed_tokens``, is stale, or is given for a running request.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"token counts must be >= 0; got {num_computed_tokens}, {num_new_tokens}")
        num_slots = num_computed_tokens + num_new_tokens
        computed_ids = list(computed.block_ids if isinstance(computed, ComputedBlocks) else computed or ())
        state = self._requests.get(req_id)
        if state is not None:
            if computed_ids:
                raise ValueError(f"request {req_id} already holds blocks; computed is for admission only")
            return self._grow(req_id, state, token_ids, num_slots)
        if len(computed_ids) * self.block_size != num_computed_tokens:
            raise ValueError(
                f"new request {req_id}: num_computed_tokens {num_computed_tokens} != "
                f"{len(computed_ids)} computed blocks x {self.block_size}"
            )
        block_hashes = self._lookup_hashes(req_id, token_ids, cache_salt)
        self._check_computed(req_id, computed_ids, block_hashes, token_ids, cache_salt)
        pool = self.block_pool
        num_needed = max(-(-num_slots // self.block_size) - len(computed_ids), 0)
        num_revived = sum(pool.blocks[i].ref_cnt == 0 for i in computed_ids)
        if num_needed + num_revived > pool.num_free_blocks:
            logger.debug("allocate %s: short of blocks (need %d, %d free)", req_id, num_needed + num_revived,
                         pool.num_free_blocks)
            return None
        pool.touch(computed_ids)
        state = self._requests[req_id] = _RequestState(
            computed_ids, block_hashes, len(computed_ids), 0, 0, cache_salt
        )
        self._last_lookup = None
        if computed is not None:
            self._prefix_cache_queries += len(token_ids)
            self._prefix_cache_hits += num_computed_tokens
        return self._grow(req_id, state, token_ids, num_slots)  # NOTE: cannot fail: blocks counted above

    def free(self, req_id: str) -> None:
        """Drops the request's references, tail block first; unknown ids are a no-op.

        Unreferenced hashed blocks stay cached in the LRU, tail first, so a prompt's
        tail is evicted before its head (the head is what other prompts share).
        """
        if self._last_lookup is not None and self._last_lookup.req_id == req_id:
            self._last_lookup = None
        state = self._requests.pop(req_id, None)
        if state is None:
            return
        self.block_pool.free_blocks(reversed(state.block_ids))
        logger.debug("free %s: %d blocks", req_id, len(state.block_ids))

    def free_tail(self, req_id: str, num_tokens: int) -> None:
        """Shrinks the request's table to its first ``num_tokens`` slots (rejected draft tokens
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
        tail = state.block_ids[num_kept:]
        del state.block_ids[num_kept:]
        state.num_slots = min(state.num_slots, num_tokens)
        self.block_pool.free_blocks(reversed(tail))
        logger.debug("free_tail %s: %d tokens, %d blocks freed", req_id, num_tokens, len(tail))

    def fork(self, parent_req_id: str, child_req_id: str) -> int:
        """Gives a new child request the parent's computed full blocks (+1 reference each).

        The child's partial tail, and at least its last token, are recomputed by the child.

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
        num_shared = max(min(parent.num_slots, parent.num_tokens - 1), 0) // self.block_size
        shared_ids = parent.block_ids[:num_shared]
        self.block_pool.touch(shared_ids)
        num_computed = num_shared * self.block_size
        self._requests[child_req_id] = _RequestState(
            shared_ids, parent.block_hashes[:num_shared], num_shared, num_computed, parent.num_tokens,
            parent.cache_salt,
        )
        logger.debug("fork %s -> %s: %d shared blocks", parent_req_id, child_req_id, num_shared)
        return num_computed

    # ---------------------------------------------------------------------------- persistence

    def track_block_origins(self) -> None:
        """Keeps the origin (parent hash, tokens, salt) of every block registered from now on.

        Persisting the cache needs them (``persistable_blocks``); without persistence nothing is kept.
        """
        if self.block_origins is None:
            self.block_origins = {}

    def restore_cached_block(self, block_hash: BlockHash, origin: BlockOrigin) -> int | None:
        """Registers a block read back from disk as cached: unreferenced, evictable, its hash indexed.

        The caller writes the block's K/V before the next lookup. Restored blocks are evicted
        before any other cached block, a chain's last block first.

        Returns:
            The block's id; None when the pool has no free block or the hash is cached already.
        """
        block = self.block_pool.restore_cached_block(block_hash)
        if block is None:
            return None
        if self.block_origins is not None:
            self.block_origins[block_hash] = origin
        return block.block_id

    def persistable_blocks(self, req_ids: Sequence[str], num_hot: int) -> list[tuple[int, BlockHash, BlockOrigin]]:
        """The cached blocks worth persisting, each after its parent, as (block id, hash, origin).

        First every registered full block of ``req_ids`` (pinned prefixes); then up to ``num_hot``
        more, the most recently used first (referenced blocks, then the evictable ones most
        recently freed first), each with the ancestors it needs to be hit. A block whose chain
        is no longer cached whole, or whose origin was not tracked, is left out.
        """
        origins = self.block_origins or {}
        pool = self.block_pool
        chosen: dict[BlockHash, tuple[int, BlockOrigin]] = {}

        def chain_to(block_hash: BlockHash) -> list[tuple[BlockHash, int, BlockOrigin]] | None:
            """The blocks from ``block_hash`` back to the first one not chosen yet, deepest first; None if broken."""
            chain: list[tuple[BlockHash, int, BlockOrigin]] = []
            current: BlockHash | None = block_hash
            while current is not None and current not in chosen:
                block, origin = pool.get_cached_block(current), origins.get(current)
                if block is None or origin is None:
                    return None
                chain.append((current, block.block_id, origin))
                current = origin.parent_hash
            return chain

        def choose(chain: list[tuple[BlockHash, int, BlockOrigin]]) -> None:
            for block_hash, block_id, origin in reversed(chain):
                chosen[block_hash] = (block_id, origin)

        for req_id in req_ids:
            state = self._requests.get(req_id)
            if state is not None and state.num_cached_blocks:
                for block_hash in state.block_hashes[: state.num_cached_blocks]:
                    chain = chain_to(block_hash)
                    if chain is None:
                        break
                    choose(chain)
        budget = num_hot
        referenced = (block.block_id for block in pool.blocks if block.ref_cnt > 0 and block.block_hash is not None)
        for block_id in itertools.chain(referenced, reversed(pool.evictable)):
            if budget <= 0:
                break
            block_hash = pool.blocks[block_id].block_hash
            chain = chain_to(block_hash) if block_hash is not None else None
            if chain and len(chain) <= budget:
                choose(chain)
                budget -= len(chain)
        return [(block_id, block_hash, origin) for block_hash, (block_id, origin) in chosen.items()]

    def reset_prefix_cache(self) -> None:
        """Forgets the hashes of every unreferenced block (their content may be unwritten)."""
        num_dropped = self.block_pool.reset_prefix_cache()
        logger.debug("reset prefix cache: %d cached blocks dropped", num_dropped)

    @property
    def req_ids(self) -> list[str]:
        """The requests that hold a block table (running, or pinned prefixes)."""
        return list(self._requests)

    def get_block_ids(self, req_id: str) -> list[int]:
        """Returns a copy of the request's block table.

        Raises:
            KeyError: The request holds no blocks.
        """
        return list(self._requests[req_id].block_ids)

    def stats(self) -> KVCacheStats:
        """Returns the current figures (O(number of requests))."""
        pool = self.block_pool
        num_used = pool.num_used_blocks
        # NOTE: only a table's last block can be partial, and it is never shared.
        num_empty = sum(len(s.block_ids) * self.block_size - s.num_slots for s in self._requests.values())
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
            table = state.block_ids
            check_invariant(len(set(table)) == len(table), f"request {req_id}'s table holds a block twice")
            check_invariant(len(table) * self.block_size >= state.num_slots, f"request {req_id}'s table is short")
            check_invariant(state.num_cached_blocks <= len(table), f"request {req_id} cached blocks beyond its table")
            holders.update(table)
            for i in range(state.num_cached_blocks):
                block_hash = self.block_pool.blocks[table[i]].block_hash
                check_invariant(
                    block_hash is None or block_hash == state.block_hashes[i],
                    f"request {req_id}'s block {table[i]} carries another chain's hash",
                )
        for block in self.block_pool.blocks:
            check_invariant(
                block.ref_cnt == holders[block.block_id],
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but {holders[block.block_id]} tables hold it",
            )

    def _lookup_hashes(self, req_id: str, token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        lookup = self._last_lookup
        if lookup is not None and (lookup.req_id, lookup.cache_salt) == (req_id, cache_salt):
            if lookup.token_ids is token_ids:
                return lookup.block_hashes
        return []

    def _check_computed(
        self,
        req_id: str,
        computed_ids: list[int],
        block_hashes: list[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> None:
        if not computed_ids:
            return
        if not self.enable_prefix_caching:
            raise ValueError(f"request {req_id}: computed blocks given with prefix caching off")
        extend_block_hashes(block_hashes, token_ids, len(computed_ids) * self.block_size, self.block_size, cache_salt)
        for i, block_id in enumerate(computed_ids):
            if i >= len(block_hashes) or self.block_pool.blocks[block_id].block_hash != block_hashes[i]:
                raise ValueError(
                    f"request {req_id}: computed block {block_id} no longer holds its prefix "
                    "(evicted since get_computed_blocks?)"
                )

    def _grow(self, req_id: str, state: _RequestState, token_ids: Sequence[int], num_slots: int) -> list[int] | None:
        num_needed = -(-num_slots // self.block_size) - len(state.block_ids)
        if num_needed > 0:
            if num_needed > self.block_pool.num_free_blocks:
                logger.debug("allocate %s: short of blocks (need %d, %d free)", req_id, num_needed,
                             self.block_pool.num_free_blocks)
                return None
            state.block_ids.extend(block.block_id for block in self.block_pool.get_new_blocks(num_needed))
            logger.debug("allocate %s: %d new blocks, table %s", req_id, num_needed, state.block_ids)
        if num_slots > state.num_slots:
            state.num_slots = num_slots
        state.num_tokens = len(token_ids)
        if self.enable_prefix_caching:
            self._cache_full_blocks(state, token_ids)
        return list(state.block_ids)

    def _cache_full_blocks(self, state: _RequestState, token_ids: Sequence[int]) -> None:
        num_full = min(state.num_slots, len(token_ids)) // self.block_size
        if num_full <= state.num_cached_blocks:
            return
        extend_block_hashes(state.block_hashes, token_ids, num_full * self.block_size, self.block_size,
                            state.cache_salt)
        pool = self.block_pool
        origins = self._origins_with_room()
        for i in range(state.num_cached_blocks, num_full):
            if pool.cache_full_block(pool.blocks[state.block_ids[i]], state.block_hashes[i]) and origins is not None:
                start = i * self.block_size
                parent = state.block_hashes[i - 1] if i else None
                origins[state.block_hashes[i]] = BlockOrigin(
                    parent, tuple(token_ids[start : start + self.block_size]), state.cache_salt
                )
        state.num_cached_blocks = num_full

    def _origins_with_room(self) -> dict[BlockHash, BlockOrigin] | None:
        """``block_origins``, first pruned to the indexed hashes once it holds twice as many as there are blocks."""
        origins = self.block_origins
        if origins is not None and len(origins) >= 2 * self.num_blocks:  # NOTE: amortised O(1) per block cached
            index = self.block_pool.cached_block_hash_to_id
            self.block_origins = origins = {h: o for h, o in origins.items() if h in index}
        return origins
