"""Steps in flight under pipeline parallelism: the engine keeps up to ``pipeline_parallel_size`` steps in the pipe,
so that while the last stage runs step k the first stage runs step k+1 (vLLM keeps as many batches in flight as
there are stages, with no setting; here too, except under speculative decoding, which runs one step at a time).

A request's next token depends on the one its step brings back, so a request is in at most one step in flight: the
scheduler leaves out the requests of the steps in flight (``Scheduler.schedule(in_flight=...)``) and gives each step
at most its share of the others (``StepsInFlight.micro_batch``), so that the running requests split into ``depth``
micro-batches that take turns, as vLLM's virtual engines do. Each step's logits are sampled when they come
back, in the order the steps went in (``ParallelRunner.submit`` / ``collect``).

What may change while a step is in the pipe, and why that is safe:

- a request is aborted, fails or is preempted: its blocks go back at once. A later step that takes them runs after
  the step in flight on every stage (each stage runs the steps in the order the driver sent them), so its K/V land
  after the stale ones; the request's logits are dropped when they come back (``StepInFlight.live_rows``), and a
  preempted request is not readmitted before its step came back.
- a later step hits prefix blocks a step in flight fills (hashed when scheduled, as within one step): every stage
  runs it after the step that writes them.
- persisted blocks are read between steps (``kv_cache_dir``): the ranks' calls queue behind the steps sent before,
  and the driver posted each step's logits receive when it sent the step, so no rank waits on the driver meanwhile.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine import debug_log
from engine.core.scheduler_output import SchedulerOutput
from engine.errors import EngineError
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler
    from engine.output_processor import ParentRequest
    from engine.persisted_kv import PersistedKVCache

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepInFlight:
    """A step the driver sent into the pipe and whose logits have not come back yet."""

    scheduler_output: SchedulerOutput
    rows: list[tuple[Request, int]]  # the requests it brings logits for, in batch order, with their num_preemptions
    submitted_at: float  # perf_counter when it was scheduled

    def live_rows(self) -> tuple[list[int], list[Request]]:
        """The logits rows still to sample and their requests: those still running as they were when scheduled
        (not finished, aborted or preempted meanwhile)."""
        keep = [i for i, (r, n) in enumerate(self.rows) if r.status == RequestStatus.RUNNING and r.num_preemptions == n]
        return keep, [self.rows[i][0] for i in keep]


class StepsInFlight:
    """The steps in the pipe, oldest first, and the requests in them; at most ``depth`` at once."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._steps: deque[StepInFlight] = deque()
        self.req_ids: set[str] = set()  # NOTE: a request is in one step in flight at most

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def is_full(self) -> bool:
        return len(self._steps) >= self.depth

    def micro_batch(self, scheduler: Scheduler) -> int:
        """Most requests the next step takes: an equal share of the running and waiting requests (up to
        ``max_num_seqs``) not in the pipe, over the steps the pipe has room for, so that ``depth`` steps hold them
        all (9 requests over 4 stages: 3, 2, 2, 2)."""
        num_in_pipe = sum(request.req_id in self.req_ids for request in scheduler.running)
        num_requests = min(scheduler.num_running + scheduler.num_waiting, scheduler.max_num_seqs) - num_in_pipe
        return max(1, math.ceil(num_requests / (self.depth - len(self._steps))))

    def push(self, step: StepInFlight) -> None:
        self._steps.append(step)
        self.req_ids.update(s.req_id for s in step.scheduler_output.scheduled)

    def pop(self) -> StepInFlight:
        step = self._steps.popleft()
        self.req_ids.difference_update(s.req_id for s in step.scheduler_output.scheduled)
        return step

    def clear(self) -> list[StepInFlight]:
        """Forgets every step (the pipeline failed); returns them."""
        steps = list(self._steps)
        self._steps.clear()
        self.req_ids.clear()
        return steps


class PipelinedSteps:
    """``Engine``'s step with steps in flight (``steps_in_flight``), over its parts and request lifecycle."""

    if TYPE_CHECKING:  # what Engine provides
        scheduler: Scheduler
        runner: Any
        persisted_kv: PersistedKVCache | None
        step_log: debug_log.StepLog
        steps_in_flight: StepsInFlight | None
        _parents: dict[str, ParentRequest]
        _debug: bool
        _busy_seconds: float

        def pinned_prefix_ids(self) -> list[str]: ...
        def _after_schedule(self, scheduler_output: SchedulerOutput, touched: dict[str, None]) -> None: ...
        def _fail_step(self, exc: Exception, req_ids: list[str], touched: dict[str, None]) -> None: ...
        def _sample_and_process(self, logits: Any, rows: list[Request], touched: dict[str, None]) -> dict[str, int]: ...

    def _pipelined_step(self) -> list[ParentRequest]:
        """Sends the next step into the pipe while there is room and something to schedule, then samples the
        oldest step's logits once the pipe is full (or nothing new went in); returns the user requests changed."""
        steps = self.steps_in_flight
        assert steps is not None
        start = time.perf_counter()
        debug = debug_log.is_enabled()
        if debug and not self._debug:
            self.step_log.start()
        self._debug = debug
        touched: dict[str, None] = {}  # parent ids, in order
        submitted = False
        if not steps.is_full:
            if self.persisted_kv is not None:  # NOTE: the ranks' reads queue behind the steps in flight
                self.persisted_kv.save_if_due(self.pinned_prefix_ids())
            submitted = self._submit_step(steps, start, debug, touched)
        if len(steps) and (steps.is_full or not submitted):
            self._collect_step(steps, touched)
        self._busy_seconds += time.perf_counter() - start
        return [parent for parent_id in touched if (parent := self._parents.get(parent_id)) is not None]

    def _submit_step(self, steps: StepsInFlight, start: float, debug: bool, touched: dict[str, None]) -> bool:
        """Schedules a micro-batch of the requests not in flight and sends it into the pipe; False: none to send."""
        scheduler = self.scheduler
        scheduler.events = [] if debug else None
        scheduler_output = scheduler.schedule(steps.req_ids, steps.micro_batch(scheduler))
        scheduled_at = time.perf_counter()
        requests_after_schedule = dict(scheduler.requests) if debug else {}
        self._after_schedule(scheduler_output, touched)
        if not scheduler_output.scheduled:
            return False
        requests = scheduler.requests
        logit_requests = (requests[s.req_id] for s in scheduler_output.scheduled if s.needs_logits)
        rows = [(request, request.num_preemptions) for request in logit_requests]
        try:
            self.runner.submit(scheduler_output)
        except Exception as exc:
            self._fail_pipeline(exc, [StepInFlight(scheduler_output, rows, start)], touched)
            raise
        steps.push(StepInFlight(scheduler_output, rows, start))
        if debug:
            times = (start, scheduled_at, time.perf_counter(), time.perf_counter())
            self.step_log.step(scheduler_output, requests_after_schedule, scheduler.events or [], times)
        return True

    def _collect_step(self, steps: StepsInFlight, touched: dict[str, None]) -> None:
        """Samples the oldest step's logits for the requests still running as they were when it was scheduled."""
        step = steps.pop()
        try:
            logits = self.runner.collect()
        except Exception as exc:
            self._fail_pipeline(exc, [step], touched)
            raise
        keep, rows = step.live_rows()
        if len(keep) < len(step.rows):
            logits = logits[keep]
        if rows:
            self._sample_and_process(logits, rows, touched)
        # NOTE: scheduled to sampled, the step in flight beside it included: the time its decodes waited
        self.scheduler.record_step(step.scheduler_output, time.perf_counter() - step.submitted_at)

    def _fail_pipeline(self, exc: Exception, failed: list[StepInFlight], touched: dict[str, None]) -> None:
        """A step could not be sent or its logits did not come back: the pipe holds no step any more, so the
        requests of every step in it fail (and with a dead group every request: ``_fail_step``)."""
        assert self.steps_in_flight is not None
        failed = failed + self.steps_in_flight.clear()
        req_ids = [s.req_id for step in failed for s in step.scheduler_output.scheduled]
        logger.exception("a step in the pipeline failed; failing the %d requests in flight", len(req_ids))
        self._fail_step(exc, req_ids, touched)

    def _drain_steps(self) -> None:
        """Waits for every step in flight and drops its logits (the engine closes; its requests ended)."""
        steps = self.steps_in_flight
        while steps:
            steps.pop()
            try:
                self.runner.collect()
            except EngineError as exc:  # a dead group: nothing left to wait for
                logger.warning("steps in flight lost at close: %s", exc)
                steps.clear()
