"""Scheduler: which requests run in the next step, under a token budget.

No phases: each step hands every running request its next tokens (one for a decode,
a chunk for a prompt still being prefilled), then admits waiting requests while the
budget, ``max_num_seqs`` and the KV cache allow. Pure Python; the only tensors live in
the runner.

Queues::

    running   list sorted by (priority, arrival): scheduled front to back; the back is
              the preemption victim (lowest priority, latest arrival)
    waiting   heap of (priority, arrival, request): new and preempted requests; aborted
              entries are dropped lazily when they reach the top
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections.abc import Collection, Iterable

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_KEEPS_BLOCKS = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def _order(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival_seq)


class Scheduler:
    """Owns the waiting and running queues and every request's status.

    Args:
        kv_cache_manager: The block tables; the scheduler allocates and frees through it.
        max_num_seqs: Most requests running at once.
        max_num_batched_tokens: Most tokens computed in one step.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Request] = {}  # unfinished requests by req_id
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, Request]] = []
        self._num_waiting = 0
        self._finished_req_ids: set[str] = set()  # since the last schedule()
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # tokens at prompt positions the model computed
        # Requests schedule() had to finish because the KV cache cannot hold them; the engine
        # drains this list after each schedule() to emit their last output.
        self.capped: list[Request] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def add_request(self, request: Request) -> None:
        """Queues a new request (status WAITING).

        Raises:
            ValueError: A request with this id is already unfinished.
        """
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self._push_waiting(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finishes requests wherever they are (abort, stop string, fault); frees their blocks now.

        Unknown or already finished ids are skipped.

        Returns:
            The requests finished by this call.
        """
        assert status.is_finished
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def schedule(self) -> SchedulerOutput:
        """Decides the next step: decode and prefill-chunk tokens of running requests, then admissions.

        Every scheduled request's ``num_computed_tokens`` already counts this step's tokens
        when this returns.
        """
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        running = self.running
        allocate_slots = self.kv.allocate_slots
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            token_ids = request.all_token_ids
            start = request.num_computed_tokens
            num_new = len(token_ids) - start
            if num_new == 1:  # the decode fast path: no prompt accounting, no slicing
                block_ids = allocate_slots(request.req_id, token_ids, start, 1, cache_salt=request.cache_salt)
                if block_ids is not None:
                    request.num_computed_tokens = start + 1
                    scheduled.append(ScheduledRequest(request.req_id, [token_ids[-1]], start, block_ids, True))
                    budget -= 1
                    i += 1
                    continue
            else:
                # NOTE: a prefill chunk leaves one token of budget to every request behind it,
                # so a long prompt never stalls the others' next token.
                num_new = min(num_new, budget - (len(running) - i - 1))
                if num_new <= 0:
                    i += 1
                    continue
                block_ids = self._allocate(request, num_new)
            while block_ids is None:
                victim = running[-1]
                if victim is request and i == 0:
                    # Alone and still short: the cache cannot hold this request any longer.
                    self._finish(running.pop(), RequestStatus.FINISHED_LENGTH_CAPPED)
                    self.capped.append(request)
                    break
                self._preempt(running.pop())
                preempted = True
                if victim is request:
                    break
                block_ids = self._allocate(request, num_new)
            if block_ids is None:
                continue  # ``request`` left the running list; nothing behind it remains
            scheduled.append(self._schedule(request, num_new, block_ids))
            budget -= num_new
            i += 1

        # NOTE: no admissions in a step that preempted (the cache is already too small), unless
        # the request outranks a running one; out of seats or blocks, a request that outranks
        # the last running one preempts it.
        while self._num_waiting and budget > 0:
            request = self._peek_waiting()
            if preempted and running and running[-1].priority <= request.priority:
                break
            if len(running) >= self.max_num_seqs:
                freed = self._preempt_outranked(request, scheduled)
                if freed is None:
                    break
                budget += freed
                continue
            computed = self.kv.get_computed_blocks(request.req_id, request.all_token_ids, request.cache_salt)
            num_new = min(request.num_tokens - computed.num_computed_tokens, budget)
            block_ids = self.kv.allocate_slots(
                request.req_id,
                request.all_token_ids,
                computed.num_computed_tokens,
                num_new,
                computed=computed,
                cache_salt=request.cache_salt,
            )
            if block_ids is None:
                if not running:  # nothing will ever free blocks for it (pinned prefixes hold them)
                    self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
                    self.capped.append(request)
                    continue
                freed = self._preempt_outranked(request, scheduled)
                if freed is None:
                    break
                budget += freed
                continue
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = computed.num_computed_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed.num_computed_tokens
            bisect.insort(running, request, key=_order)
            scheduled.append(self._schedule(request, num_new, block_ids))
            budget -= num_new

        finished, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(scheduled=scheduled, finished_req_ids=finished)

    def update_from_output(
        self, requests: list[Request], token_ids: list[int], stopped: Collection[str] = ()
    ) -> list[Request]:
        """Appends each request's sampled token and finishes those that reached a stop condition.

        This is where a request's finish reason is decided: a stop token (EOS or
        ``stop_token_ids``), a stop string (``stopped``, found by the output processor in the
        text this token completes), then ``max_tokens`` and the length cap.

        Args:
            requests: The requests whose logits the step produced, in batch order.
            token_ids: One sampled token per request.
            stopped: Ids of the requests whose text reached a stop string with this token.

        Returns:
            The requests this finished (their blocks already freed).
        """
        finished = []
        for request, token_id in zip(requests, token_ids):
            if request.is_finished:
                continue
            request.append_token(token_id)
            status = self._check_stop(request, token_id, request.req_id in stopped)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    def _check_stop(self, request: Request, token_id: int, hit_stop_string: bool) -> RequestStatus | None:
        num_output = request.num_output_tokens
        if hit_stop_string or request.is_stop_token(token_id, num_output):
            return RequestStatus.FINISHED_STOPPED
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and num_output >= max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.max_num_tokens is not None and request.num_tokens >= request.max_num_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _allocate(self, request: Request, num_new: int) -> list[int] | None:
        return self.kv.allocate_slots(
            request.req_id, request.all_token_ids, request.num_computed_tokens, num_new,
            cache_salt=request.cache_salt,
        )

    def _schedule(self, request: Request, num_new: int, block_ids: list[int]) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        request.num_computed_tokens = end
        if start < request.num_prompt_tokens:
            self.num_prompt_tokens_computed += min(end, request.num_prompt_tokens) - start
        return ScheduledRequest(
            req_id=request.req_id,
            token_ids=request.all_token_ids[start:end],
            num_computed_tokens=start,
            block_ids=block_ids,
            needs_logits=end == request.num_tokens,
        )

    def _preempt_outranked(self, request: Request, scheduled: list[ScheduledRequest]) -> int | None:
        """Preempts the last running request if ``request`` has a strictly better priority.

        Its share of this step, if it had one, is taken back out of ``scheduled``.

        Returns:
            The budget tokens given back, or None when nothing running is outranked.
        """
        running = self.running
        if not running or running[-1].priority <= request.priority:
            return None
        victim = running.pop()
        freed = 0
        for i in range(len(scheduled) - 1, -1, -1):
            share = scheduled[i]
            if share.req_id == victim.req_id:
                del scheduled[i]
                freed = share.num_tokens
                end = share.num_computed_tokens + freed
                if share.num_computed_tokens < victim.num_prompt_tokens:
                    self.num_prompt_tokens_computed -= min(end, victim.num_prompt_tokens) - share.num_computed_tokens
                break
        self._preempt(victim)
        return freed

    def _preempt(self, request: Request) -> None:
        logger.debug("preempt %s", request.req_id)
        self.kv.free(request.req_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status in _QUEUED:
            self._num_waiting -= 1  # its heap entry is dropped when it reaches the top
        request.status = status
        # NOTE: a pinned prefix that computed its prompt keeps its blocks (the engine unpins it);
        # aborted or failed, it holds nothing.
        if not (request.keep_blocks and status in _KEEPS_BLOCKS):
            self.kv.free(request.req_id)
        self.requests.pop(request.req_id, None)
        self._finished_req_ids.add(request.req_id)

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self._waiting, (request.priority, request.arrival_seq, request))
        self._num_waiting += 1
        if len(self._waiting) > 2 * self._num_waiting + 64:
            self._waiting = [e for e in self._waiting if e[2].status in _QUEUED]
            heapq.heapify(self._waiting)

    def _peek_waiting(self) -> Request:
        waiting = self._waiting
        while waiting[0][2].status not in _QUEUED:
            heapq.heappop(waiting)
        return waiting[0][2]
