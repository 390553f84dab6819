"""KV cache groups: a sliding-window group holds only its window's blocks, prefix hits need only what each
group reads, and every block comes back after finish, abort and preemption."""

from __future__ import annotations

import pytest

from engine.core.kv_cache_groups import NULL_BLOCK
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

BS = 4


def held(table: list[int]) -> list[int]:
    return [block for block in table if block != NULL_BLOCK]


def admit(kv: KVCacheManager, req_id: str, tokens: list[int], chunk: int) -> tuple[list[int], ...] | None:
    computed = kv.get_computed_blocks(req_id, tokens)
    num_new = min(len(tokens) - computed.num_computed_tokens, chunk)
    return kv.allocate_slots(req_id, tokens, computed.num_computed_tokens, num_new, computed)


@pytest.mark.parametrize("window", [8, 10, 24])
def test_sliding_group_holds_its_window_only_while_the_full_group_holds_all(window: int) -> None:
    """A 101-token prompt in chunks of 16, then 30 decodes: the sliding table is NULL_BLOCK exactly up to the
    block of the first key the next token reads, and holds at most ceil((W - 1 + n) / bs) + 1 blocks for a
    step of n tokens, ceil(W / bs) + 1 in a decode."""
    kv = KVCacheManager(200, BS, True, (None, window))
    tokens = list(range(1000, 1101))
    chunk, computed = 16, 0
    tables = admit(kv, "a", tokens, chunk)
    while True:
        assert tables is not None
        full, sliding = tables
        num_new = min(chunk, len(tokens) - computed)
        end = computed + num_new
        assert held(full) == full and len(full) == -(-end // BS)
        first = max(computed - window + 1, 0) // BS  # the block of the first key this step's queries read
        assert sliding[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in sliding[first:]
        assert len(held(sliding)) <= -(-(window - 1 + num_new) // BS) + 1
        if num_new == 1:
            assert len(held(sliding)) <= -(-window // BS) + 1
        kv.check_integrity()
        assert kv.block_pool.num_used_blocks == len(full) + len(held(sliding))
        computed = end
        if computed == 131:
            break
        if computed == len(tokens):
            tokens.append(7)
        tables = kv.allocate_slots("a", tokens, computed, min(chunk, len(tokens) - computed))
    kv.free("a")
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def _run(kv: KVCacheManager, req_id: str, tokens: list[int], num_decodes: int) -> list[int]:
    """Prefills ``tokens`` in one step, then decodes ``num_decodes`` tokens; returns the token list."""
    tokens = list(tokens)
    admit(kv, req_id, tokens, len(tokens))
    for i in range(num_decodes):
        tokens.append(500 + i)
        assert kv.allocate_slots(req_id, tokens, len(tokens) - 1, 1) is not None
    return tokens


def _evict(kv: KVCacheManager, block_ids: list[int]) -> None:
    """Evicts exactly these cached blocks (moves them to the LRU's front, then allocates them away)."""
    pool = kv.block_pool
    for block_id in reversed(block_ids):
        pool.evictable.move_to_end(block_id, last=False)
    taken = pool.get_new_blocks(len(pool.free_block_ids) + len(block_ids))
    pool.free_blocks(block.block_id for block in taken)
    assert all(pool.blocks[i].block_hash is None for i in block_ids)


def test_sliding_hit_needs_only_the_blocks_of_its_window() -> None:
    """With the head of a prompt evicted, a sliding-only model still hits up to the end of the prompt: its
    window's blocks are cached; the entries before the window are NULL_BLOCK."""
    kv = KVCacheManager(16, BS, True, (8,))
    tokens = list(range(100, 140))  # 10 full blocks
    (table,) = kv.allocate_slots("a", tokens, 0, 40, kv.get_computed_blocks("a", tokens))
    (released,) = kv.allocate_slots("a", tokens + [1], 40, 1)
    assert released[:8] == [NULL_BLOCK] * 8  # position 40 reads keys 33..40: blocks 8.. only
    kv.free("a")
    _evict(kv, table[:6])
    hit = kv.get_computed_blocks("b", tokens + [9, 9])
    assert hit.num_computed_tokens == 40 and hit.block_ids == ([NULL_BLOCK] * 8 + table[8:10],)
    (table_b,) = kv.allocate_slots("b", tokens + [9, 9], 40, 2, hit)
    assert table_b[:10] == [NULL_BLOCK] * 8 + table[8:10]
    kv.check_integrity()
    # a hit at 36 tokens would need blocks 7 and 8: with block 9 gone, that is the longest
    kv.free("b")
    _evict(kv, [table[9]])
    hit = kv.get_computed_blocks("c", tokens + [3])
    assert hit.num_computed_tokens == 36 and hit.block_ids == ([NULL_BLOCK] * 7 + table[7:9],)


def test_hybrid_hit_is_the_longest_prefix_every_group_holds() -> None:
    """Full attention needs the whole prefix, the sliding group its window at the prefix's end: a hit stops
    where either misses, and the sliding group's released head never limits it."""
    kv = KVCacheManager(40, BS, True, (None, 8))
    tokens = list(range(100, 140))
    full, sliding = kv.allocate_slots("a", tokens, 0, 40, kv.get_computed_blocks("a", tokens))
    kv.allocate_slots("a", tokens + [1], 40, 1)
    kv.free("a")
    _evict(kv, sliding[:8])  # the sliding head: a hit at 40 needs its blocks 8 and 9 only
    hit = kv.get_computed_blocks("b", tokens + [2])
    assert hit.num_computed_tokens == 40 and hit.block_ids == (full[:10], [NULL_BLOCK] * 8 + sliding[8:10])
    _evict(kv, [sliding[9]])  # at 36: blocks 7 and 8 of the window, and block 7 is gone: back to 28
    hit = kv.get_computed_blocks("c", tokens + [2])
    assert hit.num_computed_tokens == 0
    _evict(kv, [full[5]])
    assert kv.get_computed_blocks("d", tokens + [2]).num_computed_tokens == 0


def test_hybrid_hit_stops_at_the_full_groups_first_miss() -> None:
    kv = KVCacheManager(40, BS, True, (None, 8))
    tokens = list(range(100, 140))
    full, sliding = kv.allocate_slots("a", tokens, 0, 40, kv.get_computed_blocks("a", tokens))
    kv.free("a")
    _evict(kv, [full[6]])  # full attention holds 6 blocks; the window at 24 tokens: sliding blocks 4, 5
    hit = kv.get_computed_blocks("b", tokens + [2])
    assert hit.num_computed_tokens == 24 and hit.block_ids == (full[:6], [NULL_BLOCK] * 4 + sliding[4:6])
    kv.allocate_slots("b", tokens + [2], 24, 17, hit)
    kv.check_integrity()


def test_fork_shares_what_the_childs_window_finds_in_the_parent() -> None:
    kv = KVCacheManager(40, BS, True, (None, 8))
    tokens = _run(kv, "p", list(range(100, 140)), 1)  # computed 40 then 1: blocks 0..7 released
    assert kv.fork("p", "c1") == 40  # the child computes position 40 next: blocks 8, 9
    full, sliding = kv.get_block_ids("c1")
    assert len(full) == 10 and sliding == [NULL_BLOCK] * 8 + kv.get_block_ids("p")[1][8:10]
    for _ in range(3):
        tokens.append(1)
        kv.allocate_slots("p", tokens, len(tokens) - 1, 1)  # the last from 43 computed: block 8 released
    # 44 tokens, the last not sampled from yet: the child would compute from 40, reading block 8, which the
    # parent released; nor does the parent hold the window any shorter prefix needs
    assert kv.fork("p", "c2") == 0
    kv.check_integrity()
    for req_id in ("p", "c1", "c2"):
        kv.free(req_id)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_sizes_count_the_window_only() -> None:
    """A sliding-only model serves any length whose windows fit; with a full group the pool bounds it."""
    sliding = KVCacheManager(12, BS, True, (24,))
    assert sliding.num_blocks_needed(10_000, max_chunk=16) == -(-(23 + 16) // BS) + 1 == 11
    assert sliding.max_num_tokens(10_000, max_chunk=16) == 10_000
    assert sliding.max_num_tokens(10_000, max_chunk=32) == 12 * BS  # a 32-token step needs 15 blocks
    hybrid = KVCacheManager(40, BS, True, (None, 8))
    assert hybrid.num_blocks_needed(100, max_chunk=16) == 25 + 7
    assert hybrid.max_num_tokens(10_000, max_chunk=16) == (40 - 7) * BS
    assert hybrid.can_fit(20 * BS) and not hybrid.can_fit(21 * BS)


def _request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_seq=int(req_id[1:]))


@pytest.mark.parametrize("windows", [(8,), (None, 8)])
def test_scheduler_returns_every_block_after_preemption_abort_and_finish(windows: tuple[int | None, ...]) -> None:
    """Long prompts over a pool too small for all of them at once: preempted requests recompute, one is aborted,
    the rest finish; the sliding group never holds more than its bound, and the pool ends whole."""
    kv = KVCacheManager(40, BS, True, windows)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(4):
        scheduler.add_request(_request(f"r{i}", [100 + i] * 4 + list(range(200, 230 + 5 * i)), max_tokens=20))
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for share in out.scheduled:
            sliding = share.block_ids[-1]
            assert len(held(sliding)) <= -(-(8 - 1 + share.num_tokens) // BS) + 1
        rows = [scheduler.requests[s.req_id] for s in out.scheduled if s.needs_logits]
        scheduler.update_from_output(rows, [7] * len(rows))
        kv.check_integrity()
        steps += 1
        if steps == 12:
            assert scheduler.finish_requests(["r3"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_preemptions > 0 or windows == (8,)
    assert kv.num_free_blocks == kv.num_blocks and kv.block_pool.num_used_blocks == 0
    kv.check_integrity()


@pytest.mark.parametrize("windows", [(8,), (None, 8)])
def test_a_prefill_chunk_is_cut_to_what_the_sliding_groups_hold(windows: tuple[int | None, ...]) -> None:
    """A long prompt beside a decoding request, its 60-token chunks (19 blocks a sliding group) more than the
    pool's free blocks: each chunk is cut to what the groups hold now (never past the budget), nobody is
    preempted or capped, both finish, and every block comes back."""
    full = None in windows
    kv = KVCacheManager(40 if full else 14, BS, True, windows)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=61)
    scheduler.add_request(_request("r0", list(range(300, 306)), max_tokens=40))
    scheduler.add_request(_request("r1", list(range(100, 200)), max_tokens=3))
    chunks = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for share in out.scheduled:
            sliding = share.block_ids[-1]
            assert len(held(sliding)) <= -(-(8 - 1 + share.num_tokens) // BS) + 1
            if share.req_id == "r1" and share.num_computed_tokens < 100:
                chunks.append(share.num_tokens)
        rows = [scheduler.requests[s.req_id] for s in out.scheduled if s.needs_logits]
        scheduler.update_from_output(rows, [7] * len(rows))
        kv.check_integrity()
    assert sum(chunks) == 100 and 1 < len(chunks) and max(chunks) < 60  # cut, every time, to under the budget
    assert scheduler.num_preemptions == 0 and not scheduler.capped
    assert kv.num_free_blocks == kv.num_blocks and kv.block_pool.num_used_blocks == 0
