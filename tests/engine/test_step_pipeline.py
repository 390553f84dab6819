"""Steps in flight, without ranks: how the requests split into micro-batches over the pipe's free steps, and which
rows of a step that comes back are still sampled."""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.step_pipeline import StepInFlight, StepsInFlight

_arrivals = iter(range(10**9))


def make_request(req_id: str, first: int) -> Request:
    return Request(
        req_id, list(range(first, first + 4)), SamplingParams(max_tokens=8), arrival_seq=next(_arrivals),
        stop_token_ids=frozenset({0}),
    )  # fmt: skip


def fill(scheduler: Scheduler, steps: StepsInFlight) -> list[list[str]]:
    """Schedules micro-batches into ``steps`` until the pipe is full; returns each one's requests."""
    batches = []
    while not steps.is_full:
        out = scheduler.schedule(steps.req_ids, steps.micro_batch(scheduler))
        rows = [(scheduler.requests[s.req_id], 0) for s in out.scheduled if s.needs_logits]
        steps.push(StepInFlight(out, rows, 0.0))
        batches.append([s.req_id for s in out.scheduled])
    return batches


def test_nine_requests_over_four_stages_split_three_two_two_two() -> None:
    """Each step takes an equal share of the requests not in the pipe over the steps it has room for: every stage
    gets a micro-batch, none empty; the next step takes what the oldest one held once it came back."""
    scheduler = Scheduler(KVCacheManager(64, 4, True), 16, 256)
    for i in range(9):
        scheduler.add_request(make_request(f"r{i}", 10 * i + 1))
    steps = StepsInFlight(4)
    assert fill(scheduler, steps) == [["r0", "r1", "r2"], ["r3", "r4"], ["r5", "r6"], ["r7", "r8"]]
    oldest = steps.pop()
    scheduler.update_from_output([r for r, _ in oldest.rows], [7] * len(oldest.rows))
    assert fill(scheduler, steps) == [["r0", "r1", "r2"]]


def test_rows_of_requests_that_left_or_were_preempted_meanwhile_are_dropped() -> None:
    """A step's rows are sampled only for requests still running as scheduled: not finished, not preempted since
    (a later incarnation's count differs)."""
    scheduler = Scheduler(KVCacheManager(64, 4, True), 8, 256)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 10 * i + 1))
    out = scheduler.schedule()
    step = StepInFlight(out, [(scheduler.requests[s.req_id], 0) for s in out.scheduled], 0.0)
    finished, preempted, kept = (r for r, _ in step.rows)
    scheduler.finish_requests([finished.req_id], RequestStatus.FINISHED_ABORTED)
    preempted.num_preemptions = 1  # preempted and readmitted while the step was in the pipe
    assert step.live_rows() == ([2], [kept])
