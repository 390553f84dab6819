"""A minimal stand-in for scheduler + KV cache manager: assigns shuffled blocks and builds SchedulerOutputs."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput


class PagedDriver:
    """Tracks each request's tokens, computed count and block tables (one per KV cache group) over a runner's cache.

    Blocks come from a shuffled free list, so tables are never contiguous or ordered. Nothing is released:
    a sliding group keeps every block, as it may.
    """

    def __init__(self, runner, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.free_blocks = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.num_groups = len(runner.kv_cache_windows)
        self.block_ids: dict[str, list[list[int]]] = {}  # per group

    def add(self, req_id: str, prompt: list[int]) -> None:
        self.tokens[req_id], self.num_computed[req_id] = list(prompt), 0
        self.block_ids[req_id] = [[] for _ in range(self.num_groups)]

    def fork(self, req_id: str, parent: str, num_shared_blocks: int, tail: list[int]) -> None:
        """A request whose first blocks are ``parent``'s (already cached or written this step)."""
        shared = num_shared_blocks * self.block_size
        self.tokens[req_id] = self.tokens[parent][:shared] + list(tail)
        self.num_computed[req_id] = shared
        self.block_ids[req_id] = [table[:num_shared_blocks] for table in self.block_ids[parent]]

    def append(self, req_id: str, token_id: int) -> None:
        self.tokens[req_id].append(token_id)

    def step(self, chunks: dict[str, int | None]) -> dict[str, torch.Tensor]:
        """Schedule ``chunks`` (req_id -> tokens to compute, None = all pending) in one batch; logits by req_id."""
        scheduled = []
        for req_id, n in chunks.items():
            start = self.num_computed[req_id]
            n = len(self.tokens[req_id]) - start if n is None else n
            tables = self.block_ids[req_id]
            for table in tables:
                while len(table) * self.block_size < start + n:
                    table.append(self.free_blocks.pop())
            needs_logits = start + n == len(self.tokens[req_id])
            token_ids = self.tokens[req_id][start : start + n]
            block_ids = tuple(list(table) for table in tables)
            scheduled.append(ScheduledRequest(req_id, token_ids, start, block_ids, needs_logits))
        logits = self.runner.execute_model(SchedulerOutput(scheduled=scheduled))
        assert logits.shape == (sum(r.needs_logits for r in scheduled), self.runner.vocab_size)
        for req in scheduled:
            self.num_computed[req.req_id] += req.num_tokens
        return dict(zip([r.req_id for r in scheduled if r.needs_logits], logits))


def assert_forks_match(
    runner, reference: Callable[[list[int]], torch.Tensor], *, prompt_len: int, forks: tuple[int, int],
    tail_lens: tuple[int, int], decode_steps: int, atol: float,
) -> PagedDriver:  # fmt: skip
    """Runs one scenario and holds every logits row the runner returns to ``reference(tokens)[position]``.

    A prompt of ``prompt_len`` beside a 7-token one whose first chunk is 5; then the short one's rest with two forks
    of the long one (``forks`` shared blocks each, then ``tail_lens`` new tokens: a short tail and one that can
    be a chunk longer than a window); then ``decode_steps`` decodes of all four.
    """
    rng = random.Random(1)
    driver = PagedDriver(runner, seed=2)
    expected: list[tuple[str, int, torch.Tensor]] = []

    def record(out: dict[str, torch.Tensor]) -> None:
        expected.extend((req_id, len(driver.tokens[req_id]) - 1, logits) for req_id, logits in out.items())

    driver.add("a", [rng.randrange(3, 1000) for _ in range(prompt_len)])
    driver.add("b", [rng.randrange(3, 1000) for _ in range(7)])
    record(driver.step({"a": None, "b": 5}))  # b: a chunk; its rest comes next step
    for req_id, num_blocks, tail_len in zip("cd", forks, tail_lens):
        driver.fork(req_id, "a", num_blocks, [rng.randrange(3, 1000) for _ in range(tail_len)])
    record(driver.step({"b": None, "c": None, "d": None}))
    for _ in range(decode_steps):
        for req_id in "abcd":
            driver.append(req_id, rng.randrange(3, 1000))
        record(driver.step({req_id: 1 for req_id in "abcd"}))
    assert len(expected) == 1 + 3 + decode_steps * 4
    references = {req_id: reference(tokens) for req_id, tokens in driver.tokens.items()}
    for req_id, position, logits in expected:
        torch.testing.assert_close(logits, references[req_id][position], atol=atol, rtol=0)
    return driver
