"""Stateful property test: random admit / prefill chunks / decode / fork / free / preempt / reset sequences.

A shadow KV cache records, for every slot written, the (salt, token prefix) whose K/V it
holds. After every step the machine checks the manager's invariants and that every
running request reads exactly its own prefix through each group's block table (a sliding
group: at least the blocks its window still reaches). The machine runs one full-attention
group, one sliding group, and a mix of full and sliding groups.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.core.block_hash import BlockHash
from engine.core.kv_cache_groups import NULL_BLOCK
from engine.core.kv_cache_manager import KVCacheManager

BS = 4
NUM_BLOCKS = 6  # per group
WINDOWS = ((None,), (6,), (None, 6), (None, 9, 5), (None, 6, 6))  # per group; None = full attention
PREFIXES = ((), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (9, 9, 9, 9, 9))
SlotContent = tuple[str | None, tuple[int, ...]]


class _Req:
    def __init__(self, token_ids: list[int], salt: str | None) -> None:
        self.token_ids = token_ids
        self.salt = salt
        self.num_computed = 0


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(enable_prefix_caching=st.booleans(), windows=st.sampled_from(WINDOWS))
    def setup(self, enable_prefix_caching: bool, windows: tuple[int | None, ...]) -> None:
        self.num_blocks = NUM_BLOCKS * len(windows)
        self.kv = KVCacheManager(self.num_blocks, BS, enable_prefix_caching, windows)
        self.running: dict[str, _Req] = {}
        self.waiting: dict[str, _Req] = {}  # preempted: blocks freed, tokens kept
        self.slots: dict[int, SlotContent] = {}  # shadow KV cache
        self.hash_content: dict[BlockHash, tuple[SlotContent | None, ...]] = {}
        self.next_id = 0

    def _write(self, req_id: str, req: _Req, tables: tuple[list[int], ...], num_new: int) -> None:
        """Plays the runner: stores the K/V of the scheduled tokens into their slots, in every group."""
        for table in tables:
            for pos in range(req.num_computed, req.num_computed + num_new):
                block = self.kv.block_pool.blocks[table[pos // BS]]
                # NOTE: two requests never write one slot: a written block is held by its writer only.
                assert block.ref_cnt == 1, f"{req_id} writes position {pos} into shared block {block.block_id}"
                self.slots[block.block_id * BS + pos % BS] = (req.salt, tuple(req.token_ids[: pos + 1]))
        req.num_computed += num_new

    def _schedule(self, req_id: str, req: _Req, num_new: int) -> bool:
        table = self.kv.allocate_slots(req_id, req.token_ids, req.num_computed, num_new)
        if table is None:  # preempt: the scheduler frees the request and recomputes it later
            self.kv.free(req_id)
            self.waiting[req_id] = self.running.pop(req_id)
            req.num_computed = 0
            return False
        self._write(req_id, req, table, num_new)
        return True

    def _admit(self, req_id: str, req: _Req, chunk: int) -> None:
        computed = self.kv.get_computed_blocks(req_id, req.token_ids, req.salt)
        assert computed.num_computed_tokens < len(req.token_ids), "a hit must leave the last token to compute"
        num_new = min(len(req.token_ids) - computed.num_computed_tokens, chunk)
        table = self.kv.allocate_slots(
            req_id, req.token_ids, computed.num_computed_tokens, num_new, computed, req.salt
        )
        if table is None:
            self.waiting[req_id] = req
            return
        self.waiting.pop(req_id, None)
        self.running[req_id] = req
        req.num_computed = computed.num_computed_tokens
        self._write(req_id, req, table, num_new)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 1), max_size=9),
        salt=st.sampled_from([None, None, "t1"]),
        chunk=st.integers(1, 24),
    )
    def admit(self, prefix: tuple[int, ...], tail: list[int], salt: str | None, chunk: int) -> None:
        req_id = f"r{self.next_id}"
        self.next_id += 1
        self._admit(req_id, _Req(list(prefix) + tail or [0], salt), chunk)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def readmit(self, data: st.DataObject, chunk: int) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.waiting)))
        self._admit(req_id, self.waiting[req_id], chunk)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=6), chunk=st.integers(1, 9))
    def step(self, data: st.DataObject, new_tokens: list[int], chunk: int) -> None:
        """A prefill chunk for a request still in prefill, else decode (a burst of tokens, for pressure)."""
        req_id = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[req_id]
        if req.num_computed == len(req.token_ids):
            req.token_ids.extend(new_tokens)  # tokens sampled since the last step
        self._schedule(req_id, req, min(chunk, len(req.token_ids) - req.num_computed))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = data.draw(st.sampled_from(sorted(self.running)))
        parent = self.running[parent_id]
        child_id = f"r{self.next_id}"
        self.next_id += 1
        num_computed = self.kv.fork(parent_id, child_id)
        assert num_computed % BS == 0
        assert num_computed <= min(parent.num_computed, len(parent.token_ids) - 1)
        if self.kv.sliding_windows == (None,):  # a sliding window may find fewer of its blocks in the parent
            assert num_computed > min(parent.num_computed, len(parent.token_ids) - 1) - BS
        child = _Req(list(parent.token_ids), parent.salt)
        child.num_computed = num_computed
        self.running[child_id] = child

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data(), twice=st.booleans())
    def free(self, data: st.DataObject, twice: bool) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.running) + sorted(self.waiting)))
        self.kv.free(req_id)
        if twice:
            self.kv.free(req_id)
        self.running.pop(req_id, None)
        self.waiting.pop(req_id, None)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    @rule()
    def free_all_returns_the_pool(self) -> None:
        for req_id in list(self.running):
            self.kv.free(req_id)
        self.running.clear()
        self.waiting.clear()
        stats = self.kv.stats()
        assert stats.num_used_blocks == 0
        assert stats.num_free_blocks == self.num_blocks == len(self.kv.block_pool.free_block_ids) + stats.num_cached_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()

    @invariant()
    def every_request_reads_its_own_prefix(self) -> None:
        for req_id, req in self.running.items():
            for table, window in zip(self.kv.get_block_ids(req_id), self.kv.sliding_windows):
                needed = 0 if window is None else max(req.num_computed - window + 1, 0)  # the next query's first key
                for pos in range(req.num_computed):
                    if table[pos // BS] == NULL_BLOCK:
                        assert pos < needed // BS * BS, f"{req_id} released position {pos}, still in its window"
                        continue
                    slot = table[pos // BS] * BS + pos % BS
                    assert self.slots.get(slot) == (req.salt, tuple(req.token_ids[: pos + 1])), (req_id, pos)

    @invariant()
    def a_hash_always_names_the_same_content(self) -> None:
        pool = self.kv.block_pool
        for block in pool.blocks:
            if block.block_hash is None:
                continue
            assert self.kv.enable_prefix_caching
            content = tuple(self.slots.get(block.block_id * BS + i) for i in range(BS))
            assert None not in content, f"block {block.block_id} is registered before it is written"
            assert self.hash_content.setdefault(block.block_hash, content) == content

    @invariant()
    def figures_add_up(self) -> None:
        stats = self.kv.stats()
        assert stats.num_used_blocks + stats.num_free_blocks == self.num_blocks
        assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
        assert 0.0 <= stats.token_utilization <= 1.0


KVCacheMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.__doc__ = "Random operation sequences keep blocks free xor held, ref counts exact, content stable."
