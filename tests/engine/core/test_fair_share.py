"""Fair share: within a priority, tenants share seats and the token budget by weight; one tenant keeps the old order."""

from __future__ import annotations

import itertools

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.request import Request
from engine.sampling_params import SamplingParams

_arrivals = itertools.count()


def make_request(req_id: str, tenant: str | None, prompt_len: int = 4, max_tokens: int = 50, priority: int = 0,
                 weight: float = 1.0) -> Request:  # fmt: skip
    return Request(
        req_id, list(range(1, 1 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority=priority, arrival_seq=next(_arrivals), tenant=tenant, weight=weight,
    )  # fmt: skip


def make_scheduler(max_num_seqs: int = 4, budget: int = 64, num_blocks: int = 256) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4, enable_prefix_caching=False), max_num_seqs, budget)


def step(s: Scheduler) -> list[str]:
    """One step fed token 7 on every row with logits; returns the ids scheduled."""
    out = s.schedule()
    rows = [s.requests[r.req_id] for r in out.scheduled if r.needs_logits]
    s.update_from_output(rows, [7] * len(rows))
    s.kv.check_integrity()
    return [r.req_id for r in out.scheduled]


def running_by_tenant(s: Scheduler) -> dict[str | None, int]:
    counts: dict[str | None, int] = {}
    for r in s.running:
        counts[r.tenant] = counts.get(r.tenant, 0) + 1
    return counts


def test_a_newcomer_takes_a_seat_from_a_burst_at_once() -> None:
    """Seats full of tenant a's burst: b's one request preempts a's latest running request in the step it arrives."""
    s = make_scheduler(max_num_seqs=4)
    for i in range(8):
        s.add_request(make_request(f"a{i}", "a"))
    assert step(s) == ["a0", "a1", "a2", "a3"]
    s.add_request(make_request("b0", "b"))
    assert step(s) == ["a0", "a1", "a2", "b0"]  # a3, a's latest, went back to waiting
    assert s.requests["a3"].num_preemptions == 1 and s.num_waiting == 5
    assert sorted(step(s)) == ["a0", "a1", "a2", "b0"]  # 3 seats per weight against 1: no further move
    assert running_by_tenant(s) == {"a": 3, "b": 1} and s.num_preemptions == 1


def test_seats_split_by_weight_and_never_trade_back() -> None:
    """Tenant b of weight 3 against a of weight 1 on 4 seats: a keeps 1, b takes 3, and nothing moves after."""
    s = make_scheduler(max_num_seqs=4)
    for i in range(6):
        s.add_request(make_request(f"a{i}", "a"))
    step(s)
    for i in range(6):
        s.add_request(make_request(f"b{i}", "b", weight=3.0))
    step(s)
    assert running_by_tenant(s) == {"a": 1, "b": 3}
    preemptions = s.num_preemptions
    for _ in range(10):
        step(s)
    assert s.num_preemptions == preemptions == 3
    assert running_by_tenant(s) == {"a": 1, "b": 3}


def test_equal_tenants_split_seats_evenly_without_thrashing() -> None:
    """Three tenants with bursts on 4 seats settle at 2, 1, 1 or so and stop preempting: each move narrows the gap."""
    s = make_scheduler(max_num_seqs=4)
    for tenant in "abc":
        for i in range(5):
            s.add_request(make_request(f"{tenant}{i}", tenant))
        step(s)
    counts = running_by_tenant(s)
    assert sorted(counts.values()) == [1, 1, 2]
    preemptions = s.num_preemptions
    for _ in range(10):
        step(s)
    assert s.num_preemptions == preemptions


def test_the_tenant_that_used_least_is_admitted_first() -> None:
    """One seat: b's two requests alternate with a's older burst instead of waiting behind all of it."""
    s = make_scheduler(max_num_seqs=1)
    for i in range(6):
        s.add_request(make_request(f"a{i}", "a", max_tokens=2))
    step(s)
    s.add_request(make_request("b0", "b", max_tokens=2))
    s.add_request(make_request("b1", "b", max_tokens=2))
    order: list[str] = []
    while s.has_unfinished_requests():
        order.extend(r for r in step(s) if r not in order)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]
    assert s.num_preemptions == 0  # one seat each is even: no seat moves


def test_priority_still_comes_first() -> None:
    """A better priority beats any usage: a's priority -1 request runs before b's, though a used more."""
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a0", "a", max_tokens=3))
    step(s)
    s.add_request(make_request("b0", "b", max_tokens=3))
    s.add_request(make_request("a1", "a", max_tokens=3, priority=-1))
    assert step(s) == ["a1"]  # outranks a0: a0 preempted; b0 waits despite a's usage
    assert s.fair.peek().req_id == "b0"


def test_an_idle_tenant_banks_no_credit_and_is_forgotten() -> None:
    """A tenant arriving after another used 200 tokens starts level with it, and finished tenants leave no state."""
    s = make_scheduler(max_num_seqs=8, budget=256)
    s.add_request(make_request("a0", "a", prompt_len=200, max_tokens=1))
    step(s)
    assert s.fair.usage("a") is None  # a finished: forgotten
    s.add_request(make_request("a1", "a", max_tokens=20))
    step(s)
    s.add_request(make_request("b0", "b", max_tokens=20))
    assert s.fair.usage("b") == s.fair.usage("a") == 204.0  # b starts at the least active usage
    while s.has_unfinished_requests():
        step(s)
    assert s.fair.usage("a") is None and s.fair.usage("b") is None
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_one_tenant_keeps_priority_then_arrival_order() -> None:
    """Without tenants the queue is (priority, arrival), as before fair share: seats go in that order."""
    s = make_scheduler(max_num_seqs=2)
    for req_id, priority in [("x", 1), ("y", 0), ("z", 1), ("w", 0)]:
        s.add_request(make_request(req_id, None, priority=priority, max_tokens=1))
    assert step(s) == ["y", "w"]
    assert step(s) == ["x", "z"]
    assert s.num_preemptions == 0


def test_two_tenants_short_of_blocks_finish_without_a_preemption_loop() -> None:
    """Out of blocks, a request preempted to make room is not readmitted in the same step (that looped forever)."""
    s = make_scheduler(max_num_seqs=8, num_blocks=40)
    for i in range(6):
        s.add_request(make_request(f"r{i}", "a" if i % 2 else "b", prompt_len=20, max_tokens=24))
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        step(s)
    assert not s.has_unfinished_requests() and s.num_preemptions > 0
    assert s.kv.num_free_blocks == 40
