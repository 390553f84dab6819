"""KVCacheManager: exact block ids for hits, boundaries, eviction order, revival, sharing and figures."""

from __future__ import annotations

import logging

import pytest

import engine.core.block_hash as block_hash
from engine.core.kv_cache_manager import ComputedBlocks, KVCacheManager

BS = 16


def make_manager(num_blocks: int = 16, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=BS, enable_prefix_caching=enable_prefix_caching)


def admit(kv: KVCacheManager, req_id: str, token_ids: list[int], cache_salt: str | None = None) -> tuple[list[int], ...] | None:
    """Admits a request the way the scheduler does: lookup, then allocate the uncached tail."""
    computed = kv.get_computed_blocks(req_id, token_ids, cache_salt)
    num_new = len(token_ids) - computed.num_computed_tokens
    return kv.allocate_slots(req_id, token_ids, computed.num_computed_tokens, num_new, computed, cache_salt)


def snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.block_pool
    return (
        list(pool.free_block_ids),
        list(pool.evictable),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        dict(pool.cached_block_hash_to_id),
        kv.stats(),
    )


SYSTEM = list(range(1000, 1048))  # 3 full blocks


def test_shared_system_prompt_is_computed_once() -> None:
    """Requests sharing a 3-block system prompt take the first one's blocks, ref counted."""
    kv = make_manager()
    assert admit(kv, "a", SYSTEM + [1, 2, 3]) == ([0, 1, 2, 3],)
    computed = kv.get_computed_blocks("b", SYSTEM + [7, 8])
    assert computed == ComputedBlocks(([0, 1, 2],), 48)
    assert admit(kv, "b", SYSTEM + [7, 8]) == ([0, 1, 2, 4],)
    assert admit(kv, "c", SYSTEM + [9]) == ([0, 1, 2, 5],)
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(6)] == [3, 3, 3, 1, 1, 1]
    kv.check_integrity()
    for req_id in "abc":
        kv.free(req_id)
    kv.check_integrity()
    assert kv.stats().num_used_blocks == 0 and kv.stats().num_cached_blocks == 3


@pytest.mark.parametrize("num_tokens, num_hit_blocks", [(2 * BS - 1, 1), (2 * BS, 1), (2 * BS + 1, 2)])
def test_partial_block_boundary(num_tokens: int, num_hit_blocks: int) -> None:
    """16k-1, 16k, 16k+1 tokens: only full blocks hit, and at least one token is left to compute."""
    kv = make_manager()
    prompt = list(range(num_tokens))
    (table_a,) = admit(kv, "a", prompt)
    assert table_a == list(range(-(-num_tokens // BS)))
    num_registered = num_tokens // BS
    assert [kv.block_pool.blocks[i].block_hash is not None for i in table_a] == (
        [True] * num_registered + [False] * (len(table_a) - num_registered)
    )
    computed = kv.get_computed_blocks("b", prompt)
    assert computed == ComputedBlocks((list(range(num_hit_blocks)),), num_hit_blocks * BS)
    (table_b,) = admit(kv, "b", prompt)
    assert table_b[:num_hit_blocks] == table_a[:num_hit_blocks]
    # NOTE: the partial tail is never shared; b writes its own.
    assert set(table_b[num_hit_blocks:]).isdisjoint(table_a)
    kv.check_integrity()


def test_exact_block_prompt_recomputes_its_last_block_into_an_unhashed_duplicate() -> None:
    """With 2 full blocks, b recomputes block 1 into a new block that stays out of the hash index."""
    kv = make_manager()
    prompt = list(range(2 * BS))
    admit(kv, "a", prompt)
    assert admit(kv, "b", prompt) == ([0, 2],)
    assert kv.block_pool.blocks[2].block_hash is None
    kv.free("a")
    kv.free("b")
    assert list(kv.block_pool.evictable) == [1, 0] and list(kv.block_pool.free_block_ids)[-1] == 2
    kv.check_integrity()


def test_eviction_is_lru_and_tail_first() -> None:
    """Free blocks go first, then cached blocks, least recently freed first and each table's tail first."""
    kv = make_manager(num_blocks=6)
    a = list(range(40))  # blocks 0, 1 full, 2 partial
    admit(kv, "a", a)
    kv.free("a")
    assert list(kv.block_pool.free_block_ids) == [3, 4, 5, 2]
    assert list(kv.block_pool.evictable) == [1, 0]
    assert admit(kv, "b", list(range(500, 580))) == ([3, 4, 5, 2, 1],)
    assert kv.stats().num_evictions == 1
    assert kv.get_computed_blocks("a2", a) == ComputedBlocks(([0],), BS)  # the head outlived the tail
    kv.check_integrity()


def test_eviction_order_across_requests_follows_free_order() -> None:
    """Blocks of the request freed first are evicted first."""
    kv = make_manager(num_blocks=4)
    admit(kv, "x", list(range(100, 116)) + [0])  # blocks 0 (full), 1
    admit(kv, "y", list(range(200, 216)) + [0])  # blocks 2 (full), 3
    kv.free("y")
    kv.free("x")
    assert list(kv.block_pool.evictable) == [2, 0]
    assert admit(kv, "z", list(range(300, 345))) == ([3, 1, 2],)
    assert kv.get_computed_blocks("x2", list(range(100, 116)) + [0]).block_ids == ([0],)
    assert kv.get_computed_blocks("y2", list(range(200, 216)) + [0]).block_ids == ([],)
    kv.check_integrity()


def test_hit_on_an_evictable_block_revives_it() -> None:
    """A request that hits cached blocks takes them out of the LRU; pressure then cannot evict them."""
    kv = make_manager(num_blocks=4)
    prompt = list(range(40))
    admit(kv, "a", prompt)
    kv.free("a")
    assert kv.stats().num_cached_blocks == 2
    assert admit(kv, "b", prompt) == ([0, 1, 3],)
    assert kv.stats().num_cached_blocks == 0 and not kv.block_pool.evictable
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]
    assert admit(kv, "c", list(range(900, 910))) == ([2],)
    assert admit(kv, "d", [5]) is None
    kv.check_integrity()


def test_pool_exhaustion_returns_none_and_changes_nothing() -> None:
    """Short of blocks, allocate_slots answers None and leaves tables, lists, hashes and figures as they were."""
    kv = make_manager(num_blocks=4)
    prompt = list(range(2 * BS + 1))  # blocks 0, 1 full, 2 partial
    admit(kv, "a", prompt)
    kv.free("a")
    longer = prompt[: 2 * BS] + list(range(500, 540))  # hits 0, 1 (evictable) and needs 3 more
    before = snapshot(kv)
    assert kv.get_computed_blocks("b", longer).block_ids == ([0, 1],)
    assert admit(kv, "b", longer) is None  # 4 allocatable, but 2 of them are the hits themselves
    assert snapshot(kv) == before
    with pytest.raises(KeyError):
        kv.get_block_ids("b")
    kv.check_integrity()


def test_decode_growth_fails_atomically_when_the_pool_is_full() -> None:
    """A running request that needs one more block gets None and keeps its table."""
    kv = make_manager(num_blocks=2)
    tokens = list(range(2 * BS))
    assert admit(kv, "a", tokens) == ([0, 1],)
    before = snapshot(kv)
    tokens.append(7)
    assert kv.allocate_slots("a", tokens, 2 * BS, 1) is None
    assert snapshot(kv) == before and kv.get_block_ids("a") == ([0, 1],)


def test_same_step_sharing_with_a_just_registered_request() -> None:
    """A request admitted right after another in the same step hits the blocks registered at allocation."""
    kv = make_manager()
    prompt = list(range(40))
    admit(kv, "a", prompt)  # nothing computed yet: the runner writes its K/V this step
    assert kv.get_computed_blocks("b", prompt) == ComputedBlocks(([0, 1],), 32)


def test_chunked_prefill_registers_a_block_only_once_fully_scheduled() -> None:
    """A prefill chunk ending mid-block leaves that block unshared until the chunk that fills it."""
    kv = make_manager()
    prompt = list(range(40))
    computed = kv.get_computed_blocks("a", prompt)
    assert kv.allocate_slots("a", prompt, 0, 20, computed) == ([0, 1],)
    assert kv.get_computed_blocks("b", prompt).block_ids == ([0],)
    assert kv.allocate_slots("a", prompt, 20, 20) == ([0, 1, 2],)
    assert kv.get_computed_blocks("b", prompt).block_ids == ([0, 1],)
    kv.check_integrity()


def test_decode_grows_the_table_only_when_the_last_block_is_full_and_caches_filled_blocks() -> None:
    """Decode adds a block at positions 16k only; a block filled by decode is shared afterwards."""
    kv = make_manager()
    tokens = list(range(BS))
    assert admit(kv, "a", tokens) == ([0],)
    tables = []
    for t in range(BS + 1):
        tokens.append(1000 + t)
        tables.append(kv.allocate_slots("a", tokens, len(tokens) - 1, 1))
    assert tables[0] == ([0, 1],) and all(t == ([0, 1],) for t in tables[:BS])
    assert tables[BS] == ([0, 1, 2],)
    assert kv.get_computed_blocks("b", tokens).block_ids == ([0, 1],)
    kv.check_integrity()


def test_decode_steps_hash_only_the_blocks_they_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    """A running request never rehashes its prompt: 100 decode steps hash the 6 blocks they fill."""
    calls = 0
    real = block_hash._hash_packed

    def counting(*args):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return real(*args)

    kv = make_manager(num_blocks=128)
    tokens = list(range(1000))
    admit(kv, "a", tokens)
    monkeypatch.setattr(block_hash, "_hash_packed", counting)
    for t in range(100):
        tokens.append(t)
        kv.allocate_slots("a", tokens, len(tokens) - 1, 1)
    assert calls == 1100 // BS - 1000 // BS


def test_cache_salt_isolates_prefixes() -> None:
    """The same tokens under another salt (or none) never share blocks."""
    kv = make_manager()
    prompt = list(range(40))
    admit(kv, "a", prompt, cache_salt="tenant-a")
    assert kv.get_computed_blocks("b", prompt, "tenant-b").block_ids == ([],)
    assert kv.get_computed_blocks("c", prompt).block_ids == ([],)
    assert kv.get_computed_blocks("d", prompt, "tenant-a").block_ids == ([0, 1],)
    assert admit(kv, "b", prompt, cache_salt="tenant-b") == ([3, 4, 5],)
    kv.check_integrity()


def test_prefix_caching_off_never_hits_or_hashes() -> None:
    """With prefix caching off, lookups miss, no block carries a hash and freed blocks are plain free."""
    kv = make_manager(enable_prefix_caching=False)
    prompt = list(range(40))
    assert admit(kv, "a", prompt) == ([0, 1, 2],)
    assert kv.get_computed_blocks("b", prompt) == ComputedBlocks(([],), 0)
    assert admit(kv, "b", prompt) == ([3, 4, 5],)
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    kv.free("a")
    assert kv.stats().num_cached_blocks == 0 and list(kv.block_pool.free_block_ids)[-3:] == [2, 1, 0]
    with pytest.raises(ValueError, match="prefix caching off"):
        kv.allocate_slots("c", prompt, BS, 1, computed=ComputedBlocks(([3],), BS))


def test_stale_computed_blocks_are_refused() -> None:
    """Blocks evicted between lookup and allocation are detected instead of silently reused."""
    kv = make_manager(num_blocks=3)
    prompt = list(range(20))
    admit(kv, "a", prompt)
    kv.free("a")
    computed = kv.get_computed_blocks("b", prompt)
    assert computed.block_ids == ([0],)
    admit(kv, "c", list(range(100, 140)))  # takes 2, 1 and evicts 0
    with pytest.raises(ValueError, match="no longer holds its prefix"):
        kv.allocate_slots("b", prompt, BS, 4, computed)


def test_allocate_slots_validates_its_arguments() -> None:
    """Bad counts and computed blocks for a running request are caller bugs: ValueError."""
    kv = make_manager()
    with pytest.raises(ValueError, match=">= 0"):
        kv.allocate_slots("a", [1], 0, -1)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        kv.allocate_slots("a", [1] * 20, BS, 4)
    admit(kv, "a", list(range(40)))
    with pytest.raises(ValueError, match="admission only"):
        kv.allocate_slots("a", list(range(40)), 0, 40, computed=ComputedBlocks(([0],), BS))


def test_free_is_tail_first_and_idempotent() -> None:
    """free() of an unknown id or a second free is a no-op; the pool returns whole."""
    kv = make_manager(num_blocks=4)
    kv.free("nobody")
    admit(kv, "a", list(range(40)))
    kv.free("a")
    kv.free("a")
    stats = kv.stats()
    assert (stats.num_used_blocks, stats.num_cached_blocks, stats.num_free_blocks) == (0, 2, 4)
    kv.check_integrity()


def test_fork_shares_full_blocks_and_recomputes_the_tail() -> None:
    """A forked child holds the parent's full blocks (+1 ref) and computes its partial tail itself."""
    kv = make_manager()
    prompt = list(range(40))
    admit(kv, "p", prompt)
    assert kv.fork("p", "c") == 32
    assert kv.get_block_ids("c") == ([0, 1],)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 2, 1]
    assert kv.allocate_slots("c", prompt, 32, 8) == ([0, 1, 3],)
    kv.free("p")
    assert kv.get_block_ids("c") == ([0, 1, 3],) and kv.block_pool.blocks[0].ref_cnt == 1
    kv.check_integrity()


def test_fork_of_an_exact_block_prompt_leaves_the_last_token_to_compute() -> None:
    """With a prompt of k full blocks the child shares k - 1 of them."""
    kv = make_manager(enable_prefix_caching=False)
    admit(kv, "p", list(range(2 * BS)))
    assert kv.fork("p", "c") == BS
    assert kv.get_block_ids("c") == ([0],)
    with pytest.raises(KeyError):
        kv.fork("ghost", "c2")
    with pytest.raises(ValueError, match="already exists"):
        kv.fork("p", "c")
    kv.check_integrity()


def test_reset_prefix_cache_forgets_unreferenced_blocks_only() -> None:
    """After a reset, freed prompts miss while prompts still running keep hitting."""
    kv = make_manager()
    admit(kv, "a", list(range(40)))
    admit(kv, "b", list(range(100, 140)))
    kv.free("a")
    kv.reset_prefix_cache()
    assert kv.stats().num_cached_blocks == 0
    assert kv.get_computed_blocks("a2", list(range(40))).block_ids == ([],)
    assert kv.get_computed_blocks("b2", list(range(100, 140))).block_ids == ([3, 4],)
    kv.check_integrity()


def test_stats_figures() -> None:
    """Blocks used/cached/free, prefix-cache tokens, evictions and token utilization are exact."""
    kv = make_manager(num_blocks=8)
    admit(kv, "a", SYSTEM + [1, 2])  # 50 tokens: blocks 0-3
    admit(kv, "b", SYSTEM + [3])  # hits 48 of 49: blocks 0-2 + 4
    stats = kv.stats()
    assert (stats.num_blocks, stats.num_used_blocks, stats.num_cached_blocks, stats.num_free_blocks) == (8, 5, 0, 3)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (99, 48)
    assert stats.prefix_cache_hit_rate == pytest.approx(48 / 99)
    assert stats.token_utilization == pytest.approx((48 + 2 + 1) / (5 * BS))
    kv.free("a")
    kv.free("b")
    admit(kv, "c", list(range(700, 820)))  # 8 blocks: 3 + 2 freed tails, then 3 evictions
    stats = kv.stats()
    assert (stats.num_evictions, stats.num_cached_blocks, stats.num_free_blocks) == (3, 0, 0)
    assert stats.token_utilization == pytest.approx(120 / 128)
    assert make_manager().stats().token_utilization == 0.0


def test_admission_without_a_lookup_is_not_counted() -> None:
    """Only allocations that pass `computed` (admissions) count toward the prefix-cache figures."""
    kv = make_manager()
    kv.allocate_slots("a", list(range(20)), 0, 20)
    assert (kv.stats().prefix_cache_queries, kv.stats().prefix_cache_hits) == (0, 0)


def test_can_fit_and_get_block_ids() -> None:
    """can_fit compares blocks needed with the pool; get_block_ids returns a copy."""
    kv = make_manager(num_blocks=4)
    assert kv.can_fit(4 * BS) and not kv.can_fit(4 * BS + 1)
    admit(kv, "a", [1, 2, 3])
    table = kv.get_block_ids("a")
    table[0].append(99)
    assert kv.get_block_ids("a") == ([0],)
    assert kv.num_free_blocks == 3


def test_debug_logging_reports_hits_allocations_and_evictions(caplog: pytest.LogCaptureFixture) -> None:
    """The KV cache logs its decisions at DEBUG under engine.core.kv_cache_manager, and is silent by default."""
    assert not logging.getLogger("engine.core.kv_cache_manager").isEnabledFor(logging.DEBUG)
    kv = make_manager(num_blocks=2)
    with caplog.at_level(logging.DEBUG, logger="engine.core.kv_cache_manager"):
        admit(kv, "a", list(range(20)))
        kv.free("a")
        admit(kv, "b", list(range(100, 132)))
        admit(kv, "c", [1])
    text = caplog.text
    for needle in ("lookup a: 0 of 1", "allocate a: 2 new blocks", "free a", "evict 1 cached blocks, least recently used first: [0]", "allocate c: short"):
        assert needle in text
    assert all(r.name == "engine.core.kv_cache_manager" for r in caplog.records)


def test_refused_admission_succeeds_on_retry_with_the_same_hits() -> None:
    """A request refused for want of blocks is admitted once blocks are freed, hitting the same prefix."""
    kv = make_manager(num_blocks=4)
    admit(kv, "sys", SYSTEM[:32] + [1])  # blocks 0, 1 hashed, 2 partial
    admit(kv, "big", list(range(500, 516)))  # block 3, full: cached once freed
    prompt = SYSTEM[:32] + list(range(600, 620))  # hits 0, 1; needs 2 more
    assert admit(kv, "b", prompt) is None
    kv.free("big")
    assert admit(kv, "b", prompt) is None  # 1 evictable block, 2 needed
    kv.free("sys")  # free list [2], LRU [3, 1, 0]
    assert admit(kv, "b", prompt) == ([0, 1, 2, 3],)
    assert (kv.stats().prefix_cache_hits, kv.stats().num_evictions) == (32, 1)
    kv.check_integrity()


def test_preempted_request_readmits_over_its_own_cached_blocks() -> None:
    """After preemption (free), a request's prompt and output blocks are still cached for its readmission."""
    kv = make_manager()
    tokens = list(range(20))
    admit(kv, "a", tokens)
    for t in range(20):  # decode to 40 tokens: blocks 0, 1 full
        tokens.append(900 + t)
        kv.allocate_slots("a", tokens, len(tokens) - 1, 1)
    kv.free("a")
    assert kv.get_computed_blocks("a", tokens) == ComputedBlocks(([0, 1],), 32)
    assert admit(kv, "a", tokens) == ([0, 1, 3],)
    kv.check_integrity()
