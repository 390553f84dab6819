"""Scheduler with steps in flight (pipeline parallelism): requests in a step still in the pipe are left out, a cap
splits the running requests into micro-batches, and a request preempted in flight waits for its step."""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

_arrivals = iter(range(10**9))


def make_request(req_id: str, prompt_len: int = 4, max_tokens: int = 8, priority: int = 0, first: int = 1) -> Request:
    return Request(
        req_id, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens), priority=priority,
        arrival_seq=next(_arrivals), stop_token_ids=frozenset({0}),
    )  # fmt: skip


def make_scheduler(num_blocks: int = 64, budget: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4, True), 8, budget)


def ids(out: SchedulerOutput) -> list[str]:
    return [s.req_id for s in out.scheduled]


def sample(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """The step ``out`` came back: its requests still running get ``token``."""
    requests = (s.requests.get(x.req_id) for x in out.scheduled if x.needs_logits)
    rows = [r for r in requests if r is not None and r.status == RequestStatus.RUNNING]
    s.update_from_output(rows, [token] * len(rows))
    s.kv.check_integrity()


def test_a_cap_splits_the_requests_into_micro_batches_that_take_turns() -> None:
    """Four requests under a cap of two: two steps of two admitted, then each step decodes the pair not in flight."""
    s = make_scheduler()
    for i, name in enumerate("abcd"):
        s.add_request(make_request(name, first=10 * i + 1))
    first = s.schedule(max_num_scheduled=2)
    second = s.schedule(in_flight=set(ids(first)), max_num_scheduled=2)
    assert ids(first) == ["a", "b"] and ids(second) == ["c", "d"]
    sample(s, first)
    third = s.schedule(in_flight=set(ids(second)), max_num_scheduled=2)
    assert ids(third) == ["a", "b"] and all(x.num_tokens == 1 for x in third.scheduled)
    assert ids(s.schedule(in_flight=set(ids(second)) | set(ids(third)), max_num_scheduled=2)) == []


def test_a_prompt_in_flight_gets_no_next_chunk_until_its_step_returns() -> None:
    """A 9-token prompt under a 4-token budget: its next chunk (and its last token, which looks like a decode) waits
    for the chunk in flight."""
    s = make_scheduler(budget=4)
    s.add_request(make_request("a", prompt_len=9))
    out = s.schedule()
    assert [x.num_tokens for x in out.scheduled] == [4]
    assert ids(s.schedule(in_flight={"a"})) == []
    out = s.schedule()
    assert [x.num_tokens for x in out.scheduled] == [4]
    assert ids(s.schedule(in_flight={"a"})) == []  # one token left: the decode path leaves it out too
    assert [x.token_ids for x in s.schedule().scheduled] == [[9]]


def test_a_request_preempted_in_flight_is_not_readmitted_before_its_step_returns() -> None:
    """Two blocks: b's decode preempts a, whose prefill is in flight; a gives its block back at once but waits in
    the queue while its step is in the pipe, then is admitted again."""
    s = make_scheduler(num_blocks=2)
    s.add_request(make_request("b", max_tokens=2, first=1))
    s.add_request(make_request("a", priority=1, first=50))
    b_prefill = s.schedule(max_num_scheduled=1)
    a_prefill = s.schedule(in_flight={"b"}, max_num_scheduled=1)
    assert ids(b_prefill) == ["b"] and ids(a_prefill) == ["a"]
    sample(s, b_prefill)
    b_decode = s.schedule(in_flight={"a"}, max_num_scheduled=1)
    assert ids(b_decode) == ["b"] and s.requests["a"].status == RequestStatus.PREEMPTED
    assert s.kv.num_free_blocks == 0 and s.num_preemptions == 1
    assert ids(s.schedule(in_flight={"a", "b"}, max_num_scheduled=1)) == []
    sample(s, a_prefill)  # a's logits come back: dropped, a is not running
    assert s.requests["a"].num_output_tokens == 0
    sample(s, b_decode)  # b's second token: b finishes and frees its blocks
    assert "b" not in s.requests
    assert ids(s.schedule(max_num_scheduled=1)) == ["a"]


def test_no_cap_and_nothing_in_flight_schedule_as_before() -> None:
    """The defaults take every request the budget and ``max_num_seqs`` allow."""
    s = make_scheduler()
    for i, name in enumerate("abc"):
        s.add_request(make_request(name, first=10 * i + 1))
    assert ids(s.schedule()) == ["a", "b", "c"]
