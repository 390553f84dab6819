"""The step budget: decodes first, prompt chunks sized by measured step costs for an ITL target, no starvation."""

from __future__ import annotations

import math

import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import MIN_PROMPT_TOKENS, Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.step_cost import StepCost
from tests.engine.core.test_scheduler import make_request, shares, step

# a step's true seconds in these tests: base + per decode token + per prompt token
BASE, PER_DECODE, PER_PROMPT = 0.010, 0.002, 0.0005


def true_seconds(out: SchedulerOutput) -> float:
    decode = out.num_logits
    return BASE + PER_DECODE * decode + PER_PROMPT * (out.total_num_scheduled_tokens - decode)


def make(budget: int = 512, target: float | None = 0.1, num_blocks: int = 256, max_num_seqs: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4, True), max_num_seqs, budget, step_time_target=target)


def timed_step(s: Scheduler) -> SchedulerOutput:
    """One step whose time (from the true cost model above) is fed back to the scheduler."""
    out = step(s)
    s.record_step(out, true_seconds(out))
    return out


def start_decodes(s: Scheduler, n: int, max_tokens: int = 200) -> list[str]:
    ids = [f"d{i}" for i in range(n)]
    for i, req_id in enumerate(ids):
        s.add_request(make_request(req_id, prompt_len=3, max_tokens=max_tokens, first=1000 + 10 * i))
    while any(s.requests[r].num_computed_tokens < 3 for r in ids):
        timed_step(s)
    return ids


def test_step_cost_fit_recovers_the_terms() -> None:
    cost = StepCost()
    assert cost.predict(1, 1) is None and cost.prompt_tokens_within(1.0, 1) is None
    for decode, prompt in [(8, 0), (8, 100), (16, 40), (2, 300), (30, 0)]:
        cost.observe(decode, prompt, BASE + PER_DECODE * decode + PER_PROMPT * prompt)
    assert cost.coefficients() == pytest.approx((BASE, PER_DECODE, PER_PROMPT), rel=1e-4)
    # 0.1 s with 10 decode tokens leaves (0.1 - 0.01 - 0.02) / 0.0005 = 140 prompt tokens
    assert cost.prompt_tokens_within(0.1, 10) in (139, 140)
    assert cost.prompt_tokens_within(0.01, 10) == 0


def test_step_cost_fit_has_no_negative_term() -> None:
    """A kind of token never measured costs 0; a term the data would make negative is left out of the fit."""
    cost = StepCost()
    cost.observe(0, 100, 0.2)
    cost.observe(0, 300, 0.6)
    assert cost.coefficients() == pytest.approx((0.0, 0.0, 0.002), abs=1e-12)
    noisy = StepCost()
    for decode, prompt, seconds in [(1, 0, 0.05), (1, 40, 0.04), (2, 0, 0.06)]:  # more prompt, less time
        noisy.observe(decode, prompt, seconds)
    base, per_decode, per_prompt = noisy.coefficients()
    assert min(base, per_decode, per_prompt) >= 0 and per_prompt == 0
    assert noisy.prompt_tokens_within(1.0, 1) is None  # prompt tokens measured as free: no bound


def test_every_decode_runs_in_every_step_while_a_long_prompt_is_chunked() -> None:
    """N decodes and a long prompt: each step holds all N decodes, the prompt takes what is left of the budget."""
    s = make(budget=16, target=None)
    ids = start_decodes(s, 6)
    s.add_request(make_request("long", prompt_len=100, first=1))
    chunks = []
    while s.requests["long"].num_computed_tokens < 100:
        got = shares(timed_step(s))
        assert all(got[r] == 1 for r in ids)
        chunks.append(got.get("long", 0))
    assert chunks == [10] * 10  # 16 - 6 decodes


def test_chunks_shrink_to_hold_the_step_time_target() -> None:
    """With decodes running, a prompt chunk is cut to what the measured costs leave within the target."""
    target = 0.1
    s = make(budget=512, target=target, num_blocks=1024)
    ids = start_decodes(s, 8)
    s.add_request(make_request("long", prompt_len=2000, first=1))
    chunks = []
    for _ in range(8):
        out = timed_step(s)
        got = shares(out)
        assert all(got[r] == 1 for r in ids)
        chunks.append(got["long"])
        assert true_seconds(out) <= target + 1e-9
    # (0.1 - 0.01 - 8 * 0.002) / 0.0005 = 148 once the fit has steps of both kinds (the target is over
    # twice the decodes' 0.026 s)
    assert chunks[-1] in (147, 148)
    # without a target the same step takes the whole budget left
    free = make(budget=512, target=None, num_blocks=1024)
    start_decodes(free, 8)
    free.add_request(make_request("long", prompt_len=2000, first=1))
    assert shares(timed_step(free))["long"] == 512 - 8


def test_a_prompt_keeps_half_the_step_when_decodes_alone_take_the_target() -> None:
    """A target the decodes already exceed: prompt chunks may still take as long as the decodes (the step twice
    their time), MIN_PROMPT_TOKENS at least, so the prompt ends in bounded steps."""
    s = make(budget=512, target=1e-6, num_blocks=1024)
    ids = start_decodes(s, 4)
    s.add_request(make_request("long", prompt_len=600, first=1))
    steps = 0
    while s.requests["long"].num_computed_tokens < 600:
        out = timed_step(s)
        got = shares(out)
        assert all(got[r] == 1 for r in ids)
        decode_seconds = BASE + PER_DECODE * 4
        # (0.01 + 4 * 0.002) / 0.0005 = 36 once the fit knows the terms; never under the floor
        assert got["long"] >= min(MIN_PROMPT_TOKENS, 600 - s.requests["long"].num_computed_tokens + got["long"])
        if steps >= 2 and out.num_logits == 4:  # (the last chunk's logits row costs as a decode's)
            assert true_seconds(out) <= 2 * decode_seconds + 1e-9
        steps += 1
    assert steps <= math.ceil(600 / MIN_PROMPT_TOKENS)


def test_no_decode_running_takes_the_whole_budget() -> None:
    s = make(budget=64, target=1e-6)
    s.add_request(make_request("a", prompt_len=40, first=1))
    s.add_request(make_request("b", prompt_len=40, first=100))
    assert shares(timed_step(s)) == {"a": 40, "b": 24}


def test_admission_does_not_preempt_running_decodes_for_a_prefill() -> None:
    """Out of blocks, an equal-priority request waits: the decodes keep running, nothing is preempted."""
    s = make(budget=512, target=None, num_blocks=9)  # 36 slots
    ids = start_decodes(s, 2, max_tokens=12)  # each holds 1 block, grows to 4
    s.add_request(make_request("big", prompt_len=30, first=1, max_tokens=2))  # 8 blocks: 7 are free
    while any(r in s.requests for r in ids):
        running = [r for r in ids if r in s.requests]
        got = shares(timed_step(s))
        assert all(got.get(r) == 1 for r in running) and "big" not in got
    assert s.num_preemptions == 0
    assert shares(timed_step(s)) == {"big": 30}
    while s.has_unfinished_requests():
        timed_step(s)
    assert s.num_preemptions == 0 and s.kv.num_free_blocks == s.kv.num_blocks


def test_prompt_chunk_waits_rather_than_preempt_a_decode() -> None:
    """A running prompt ahead of the decodes, short of blocks, waits for their blocks instead of preempting one."""
    s = make(budget=16, target=None, num_blocks=8)  # 32 slots
    long = make_request("long", prompt_len=30, first=1, max_tokens=1)  # arrives first: ahead in the running order
    ids = start_decodes(s, 2, max_tokens=6)  # 2 blocks each at most
    s.add_request(long)
    chunks = []
    while s.has_unfinished_requests():
        running = [r for r in ids if r in s.requests]
        got = shares(timed_step(s))
        assert all(got.get(r) == 1 for r in running)
        chunks.append(got.get("long", 0))
    assert s.num_preemptions == 0
    assert chunks == [14, 0, 0, 0, 0, 16]  # a chunk, then it waits for the decodes' blocks, then the rest
    assert s.kv.num_free_blocks == s.kv.num_blocks
