"""Scheduler: token budget, chunked prefill, priorities, preemption by recompute, abort."""

from __future__ import annotations

import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

EOS = 0
_arrivals = iter(range(10**9))


def make_request(req_id: str, prompt_len: int = 4, max_tokens: int = 8, priority: int = 0, first: int = 1, **kw) -> Request:
    prompt = list(range(first, first + prompt_len))
    return Request(
        req_id, prompt, SamplingParams(max_tokens=max_tokens, **kw), priority=priority,
        arrival_seq=next(_arrivals), stop_token_ids=frozenset({EOS}),
    )


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
                   prefix_caching: bool = True) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size, prefix_caching), max_num_seqs, budget)


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedules, then feeds ``token`` to every request whose logits the step produced."""
    out = s.schedule()
    rows = [s.requests[r.req_id] for r in out.scheduled if r.needs_logits]
    s.update_from_output(rows, [token] * len(rows))
    s.kv.check_integrity()
    return out


def shares(out: SchedulerOutput) -> dict[str, int]:
    return {r.req_id: r.num_tokens for r in out.scheduled}


def assert_all_blocks_free(s: Scheduler) -> None:
    s.kv.check_integrity()
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_prefill_then_decode_with_exact_blocks() -> None:
    """A 6-token prompt takes blocks [0, 1] and computes 6 tokens, then decodes one token per step."""
    s = make_scheduler()
    s.add_request(make_request("a", prompt_len=6, max_tokens=3))
    out = step(s)
    (a,) = out.scheduled
    assert (a.token_ids, a.num_computed_tokens, a.block_ids, a.needs_logits) == ([1, 2, 3, 4, 5, 6], 0, ([0, 1],), True)
    out = step(s)
    assert out.scheduled[0].token_ids == [7] and out.scheduled[0].num_computed_tokens == 6
    out = step(s)
    assert s.num_running == 0 and not s.has_unfinished_requests()
    assert_all_blocks_free(s)


def test_chunked_prefill_under_budget() -> None:
    """A 20-token prompt under a budget of 8 runs as chunks 8, 8, 4; logits only on the last."""
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", prompt_len=20))
    chunks = [step(s).scheduled[0] for _ in range(3)]
    assert [(c.num_computed_tokens, c.num_tokens, c.needs_logits) for c in chunks] == [
        (0, 8, False), (8, 8, False), (16, 4, True)
    ]


def test_long_prefill_does_not_stall_decodes() -> None:
    """While a long prompt is chunked, every running request still gets its decode token each step."""
    s = make_scheduler(budget=8, num_blocks=64)
    s.add_request(make_request("d1", prompt_len=2, max_tokens=50))
    s.add_request(make_request("d2", prompt_len=2, max_tokens=50))
    step(s)
    s.add_request(make_request("long", prompt_len=40, first=100))
    for _ in range(5):
        out = shares(step(s))
        assert out["d1"] == 1 and out["d2"] == 1 and out["long"] == 6


def test_max_num_seqs_and_fifo_admission() -> None:
    """At most max_num_seqs run; the others wait and are admitted in arrival order."""
    s = make_scheduler(max_num_seqs=2)
    for name in "abcd":
        s.add_request(make_request(name, max_tokens=1))
    assert list(shares(step(s))) == ["a", "b"]
    assert s.num_waiting == 2
    assert list(shares(step(s))) == ["c", "d"]


def test_priority_admits_smaller_first_fifo_within() -> None:
    """Smaller priority values are admitted first; equal priorities keep arrival order."""
    s = make_scheduler(max_num_seqs=1)
    for name, prio in [("low1", 5), ("high1", 0), ("low2", 5), ("high2", 0), ("mid", 2)]:
        s.add_request(make_request(name, priority=prio, max_tokens=1))
    order = [next(iter(shares(step(s)))) for _ in range(5)]
    assert order == ["high1", "high2", "mid", "low1", "low2"]


def test_preemption_picks_lowest_priority_latest_and_resumes() -> None:
    """Out of blocks, the lowest-priority latest request is preempted (blocks freed) and resumes later."""
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a = make_request("a", prompt_len=4, max_tokens=6, priority=0)
    b = make_request("b", prompt_len=4, max_tokens=6, priority=1, first=50)
    c = make_request("c", prompt_len=4, max_tokens=6, priority=0, first=90)
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # prompts of a, b, c: one block each, plus a, b, c need a second block at their 5th token
    assert s.num_running == 3
    step(s)  # every request needs a new block: only one is free -> preempt b (priority 1), then c (latest)
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions >= 1
    assert s.num_preemptions >= 1
    while s.has_unfinished_requests():
        step(s)
    assert [r.num_output_tokens for r in (a, b, c)] == [6, 6, 6]
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in (a, b, c))
    assert_all_blocks_free(s)


def test_preempted_request_keeps_outputs_and_hits_its_cached_prefix() -> None:
    """On resume the recompute covers prompt + output so far, reusing its cached full blocks [2, 3]."""
    s = make_scheduler(num_blocks=5, block_size=4)
    a = make_request("a", prompt_len=8, max_tokens=3)
    b = make_request("b", prompt_len=8, max_tokens=6, first=40)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert [r.block_ids for r in out.scheduled] == [([0, 1],), ([2, 3],)]
    step(s)  # a takes the last free block for position 8; b finds none and is preempted
    assert b.status == RequestStatus.PREEMPTED and b.output_token_ids == [7] and s.num_preemptions == 1
    step(s)  # a finishes
    assert a.is_finished
    out = step(s)
    (resumed,) = out.scheduled
    assert (resumed.req_id, resumed.num_computed_tokens, resumed.token_ids) == ("b", 8, [7])
    assert resumed.block_ids[0][:2] == [2, 3]
    while s.has_unfinished_requests():
        step(s)
    assert b.num_output_tokens == 6
    assert_all_blocks_free(s)


def test_abort_running_and_waiting_frees_blocks_at_once() -> None:
    """Aborting frees a running request's blocks in the same call; a waiting one is never scheduled."""
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("run", prompt_len=9))
    s.add_request(make_request("wait"))
    step(s)
    assert s.kv.num_free_blocks < s.kv.num_blocks
    finished = s.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.req_id for r in finished] == ["run", "wait"]
    assert all(r.status.finish_reason == "abort" for r in finished)
    assert_all_blocks_free(s)
    assert s.num_waiting == 0 and s.num_running == 0 and not s.has_unfinished_requests()
    out = s.schedule()
    assert out.scheduled == [] and out.finished_req_ids == {"run", "wait"}


def test_stop_token_and_length() -> None:
    """EOS finishes with "stop" (after min_tokens), max_tokens with "length"."""
    s = make_scheduler()
    a = make_request("a", max_tokens=5)
    b = make_request("b", max_tokens=5, min_tokens=2)
    s.add_request(a)
    s.add_request(b)
    step(s, token=EOS)
    assert a.status == RequestStatus.FINISHED_STOPPED and b.status == RequestStatus.RUNNING
    step(s, token=EOS)
    assert b.status == RequestStatus.FINISHED_STOPPED and b.num_output_tokens == 2
    c = make_request("c", max_tokens=2, ignore_eos=True)
    c.stop_token_ids = frozenset()
    s.add_request(c)
    step(s, token=EOS)
    step(s, token=EOS)
    assert c.status.finish_reason == "length"


def test_request_capped_by_cache_capacity_finishes_with_length() -> None:
    """A lone request that outgrows the whole KV cache finishes "length" instead of preempting itself forever."""
    s = make_scheduler(num_blocks=2, block_size=4)
    a = make_request("a", prompt_len=4, max_tokens=100)
    s.add_request(a)
    for _ in range(10):
        step(s)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.num_tokens == 9
    assert s.num_preemptions == 0
    assert_all_blocks_free(s)


def test_shared_prefix_admitted_in_one_step_hits_cache() -> None:
    """A second request with the same prompt admitted in the same step reuses the first's full blocks."""
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", prompt_len=9))
    s.add_request(make_request("b", prompt_len=9))
    out = step(s)
    a, b = out.scheduled
    assert a.block_ids[0][:2] == b.block_ids[0][:2] and b.num_computed_tokens == 8 and b.num_tokens == 1
    assert s.requests["b"].num_cached_tokens == 8


def test_duplicate_id_is_rejected() -> None:
    """Two unfinished requests cannot share an id."""
    s = make_scheduler()
    s.add_request(make_request("a"))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("a"))


def test_higher_priority_request_takes_a_seat_from_a_lower_one() -> None:
    """With every seat taken, a more urgent request preempts the lowest-priority latest one and runs now."""
    s = make_scheduler(max_num_seqs=2)
    low1 = make_request("low1", priority=5, max_tokens=20)
    low2 = make_request("low2", priority=5, max_tokens=20, first=30)
    s.add_request(low1)
    s.add_request(low2)
    step(s)
    vip = make_request("vip", priority=0, max_tokens=2, first=60)
    s.add_request(vip)
    out = step(s)
    assert list(shares(out)) == ["low1", "vip"]  # low2's decode was taken back out of the step
    assert low2.status == RequestStatus.PREEMPTED and low2.num_output_tokens == 1
    same = make_request("same", priority=5, max_tokens=1, first=90)
    s.add_request(same)  # equal priority: waits, preempts nobody
    step(s)
    assert s.num_preemptions == 1
    while s.has_unfinished_requests():
        step(s)
    assert [r.num_output_tokens for r in (low1, low2, vip, same)] == [20, 20, 2, 1]
    assert_all_blocks_free(s)


def test_higher_priority_request_takes_blocks_from_a_lower_one() -> None:
    """With the cache full of low-priority work, an urgent request preempts it instead of waiting."""
    s = make_scheduler(num_blocks=4, block_size=4)
    low = make_request("low", prompt_len=12, priority=3, max_tokens=4)
    s.add_request(low)
    step(s)  # 3 blocks for the prompt, then a 4th for position 12
    step(s)
    vip = make_request("vip", prompt_len=6, priority=1, max_tokens=2, first=70)
    s.add_request(vip)
    out = step(s)
    assert list(shares(out)) == ["vip"] and low.status == RequestStatus.PREEMPTED
    while s.has_unfinished_requests():
        step(s)
    assert low.num_output_tokens == 4 and vip.num_output_tokens == 2
    assert_all_blocks_free(s)


def test_urgent_request_is_admitted_in_a_step_that_preempted() -> None:
    """A step that preempted admits no peer, but a more urgent request still gets the room left."""
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    low0 = make_request("low0", prompt_len=4, priority=5, max_tokens=12)
    low1 = make_request("low1", prompt_len=4, priority=5, max_tokens=12, first=20)
    s.add_request(low0)
    s.add_request(low1)
    for _ in range(5):  # prompts, then positions 4..7: two blocks each, the pool is full
        step(s)
    s.add_request(make_request("peer", prompt_len=3, priority=5, max_tokens=1, first=50))
    vip = make_request("vip", prompt_len=3, priority=0, max_tokens=2, first=90)
    s.add_request(vip)
    out = step(s)  # low0 needs a 3rd block for position 8: low1 is preempted, then vip gets in
    assert shares(out) == {"low0": 1, "vip": 3}
    assert low1.status == RequestStatus.PREEMPTED and low0.status == RequestStatus.RUNNING
    assert s.num_preemptions == 1
    while s.has_unfinished_requests():
        step(s)
    assert [r.num_output_tokens for r in (low0, low1, vip)] == [12, 12, 2]
    assert_all_blocks_free(s)
