"""Scheduler: which requests run in the next step, under a token budget.

No phases: each step first hands every running decode its next token (plus its drafts under
speculative decoding), then gives prompt chunks what is left: to running requests still being
prefilled, then to waiting requests admitted while ``max_num_seqs`` and the KV cache allow. With
decodes in the step, prompt chunks take at most what keeps the step within ``step_time_target``
(or twice the decodes' own time, where longer), as predicted from measured step times
(``engine.core.step_cost``), and at least ``MIN_PROMPT_TOKENS``.
Pure Python; the only tensors live in the runner.

Queues::

    running   list sorted by (priority, tenant usage, arrival), re-sorted each step:
              scheduled front to back; the back is the preemption victim (lowest
              priority, the tenant that used most, latest arrival)
    waiting   ``FairShare``: a heap per tenant; the next admitted is the best priority,
              then the tenant that used least of the budget (``engine.core.fair_share``)

Out of seats or blocks, a waiting request preempts the last running one when it has a
better priority, or takes a seat from a tenant over its fair share (``FairShare.victim_for``);
a running prompt short of blocks waits rather than preempt a decode of the step, unless it has
a better priority.
With sliding-window layers, a prefill chunk the free blocks cannot hold is first cut to what
they can (the windows release blocks as the prompt advances); only a chunk of which not one
block fits preempts.
"""

from __future__ import annotations

import bisect
import logging
import sys
import time
from collections.abc import Callable, Collection, Iterable, Sequence

from engine.core.encoder_budget import EncoderBudget
from engine.core.fair_share import FairShare
from engine.core.kv_cache_groups import BlockTables
from engine.core.kv_cache_manager import ComputedBlocks, KVCacheManager
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.core.step_cost import StepCost
from engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_KEEPS_BLOCKS = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
MIN_PROMPT_TOKENS = 32  # prompt tokens a step offers at least, whatever its time target: no prompt starves
PROMPT_SHARE_OF_STEP = 2.0  # a step may last this many times its decodes' own time, whatever its target


class Scheduler:
    """Owns the waiting and running queues and every request's status.

    Args:
        kv_cache_manager: The block tables; the scheduler allocates and frees through it.
        max_num_seqs: Most requests running at once.
        max_num_batched_tokens: Most tokens computed in one step.
        propose: ``propose(request, max_drafts, num_rows, draining)``: the draft tokens to verify after a decoding
            request's next token, ``num_rows`` the batch the step heads to (running and waiting requests, up
            to ``max_num_seqs``), ``draining`` whether none waits (speculative decoding: ``engine.spec_decode``),
            None = none.
            Drafts take budget after one token for each decode behind, before any prompt chunk.
        encoder_budget: bounds the image rows a step encodes (a multimodal model), None = no images.
        step_time_target: Seconds a step that holds decodes should take at most: its prompt chunks are
            cut to what ``step_cost`` predicts fits (``prompt_room``); None = chunks take the whole budget.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        propose: Callable[[Request, int, int, bool], Sequence[int]] | None = None,
        encoder_budget: EncoderBudget | None = None,
        step_time_target: float | None = None,
        step_cost: StepCost | None = None,
    ) -> None:
        self.kv = kv_cache_manager
        self.propose = propose
        self.encoder_budget = encoder_budget
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_time_target = step_time_target
        self.step_cost = step_cost or StepCost()  # measured step times (``record_step``), for ``prompt_room``
        self.requests: dict[str, Request] = {}  # unfinished requests by req_id
        self.running: list[Request] = []
        self.fair = FairShare()  # the waiting queue and the tenants' usage
        self._finished_req_ids: set[str] = set()  # since the last schedule()
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # tokens at prompt positions the model computed
        # Requests schedule() had to finish because the KV cache cannot hold them; the engine
        # drains this list after each schedule() to emit their last output.
        self.capped: list[Request] = []
        # Lifecycle events ("scheduled" | "resumed" | "preempted", request) since the engine set this to
        # a list; None (the default) records nothing. The engine's step log sets it.
        self.events: list[tuple[str, Request]] | None = None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return self.fair.num_waiting

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or self.fair.num_waiting > 0

    def add_request(self, request: Request) -> None:
        """Queues a new request (status WAITING).

        Raises:
            ValueError: A request with this id is already unfinished.
        """
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self.fair.add(request)
        self.fair.push(request)

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

    def schedule(self, in_flight: Collection[str] = (), max_num_scheduled: int | None = None) -> SchedulerOutput:
        """Decides the next step: every running decode's token, then prompt chunks, then admissions.

        Every scheduled request's ``num_computed_tokens`` already counts this step's tokens
        when this returns.

        Args:
            in_flight: requests in steps still in the pipeline (``engine.step_pipeline``): none is scheduled again
                until its step came back (a decode's next token is not known yet; a prompt's next chunk waits
                too); one preempted meanwhile is not readmitted.
            max_num_scheduled: most requests in this step (None: no cap but ``max_num_seqs``): a pipeline's
                micro-batch.
        """
        cap = sys.maxsize if max_num_scheduled is None else max_num_scheduled
        budget = self.max_num_batched_tokens
        if self.encoder_budget is not None:
            self.encoder_budget.start_step()
        scheduled: list[ScheduledRequest] = []
        fair = self.fair
        running = self.running
        # NOTE: usage changes only in charge() below, so this order holds for the whole step.
        running.sort(key=fair.order)
        preempted, budget = self._schedule_decodes(scheduled, budget, cap, in_flight)
        num_decode_tokens = sum(s.num_tokens for s in scheduled)
        room = min(budget, self.prompt_room(num_decode_tokens))  # prompt tokens left to give
        done = {s.req_id for s in scheduled}
        i = 0
        while i < len(running) and room > 0 and len(scheduled) < cap:
            request = running[i]
            if request.req_id in done or request.req_id in in_flight:
                i += 1
                continue
            start = request.num_computed_tokens
            num_new = self._encoder_cut(request, start, min(request.num_tokens - start, room))
            if num_new <= 0:
                i += 1
                continue
            block_ids = self._allocate(request, num_new)
            if block_ids is None and (cut := self._cut(request.req_id, start, num_new)):
                num_new, block_ids = cut, self._allocate(request, cut)
            while block_ids is None:
                victim = running[-1]
                if victim is request and len(running) == 1:
                    # Alone and still short: the cache cannot hold this request any longer.
                    self._finish(running.pop(), RequestStatus.FINISHED_LENGTH_CAPPED)
                    self.capped.append(request)
                    break
                if victim.req_id in done and victim.priority <= request.priority:
                    break  # NOTE: a prompt chunk waits rather than preempt a decode of this step
                running.pop()
                freed = self._take_back(victim, scheduled)
                room += freed
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                block_ids = self._allocate(request, num_new)
            if block_ids is None:
                i += request.status == RequestStatus.RUNNING  # still running: it waits for a later step
                continue
            scheduled.append(self._schedule(request, num_new, block_ids))
            room -= num_new
            i += 1

        # NOTE: no admissions in a step that preempted (the cache is already too small), unless
        # the request outranks a running one; out of seats or blocks, a request that outranks
        # the last running one, or whose tenant is short of its fair share, preempts one.
        # NOTE: a request preempted below to make room is not readmitted in this step: the
        # fair-share order may rank it first again, and readmitting it would preempt it again
        # for the same waiting request, forever.
        made_room: set[str] = set()
        while fair.num_waiting and room > 0 and len(scheduled) < cap:
            request = fair.peek()
            assert request is not None
            if preempted and running and running[-1].priority <= request.priority:
                break
            if request.req_id in made_room or request.req_id in in_flight:
                break
            if len(running) >= self.max_num_seqs:
                freed = self._preempt_for(request, scheduled, made_room)
                if freed is None:
                    break
                room += freed
                continue
            computed = self.kv.get_computed_blocks(
                request.req_id, request.all_token_ids, request.cache_salt, request.mm_spans
            )
            num_new = min(request.num_tokens - computed.num_computed_tokens, room)
            num_new = self._encoder_cut(request, computed.num_computed_tokens, num_new)
            if num_new == 0:
                break  # its next tokens reach an image this step cannot encode: a later step admits it
            block_ids = self._admit(request, computed, num_new)
            start = computed.num_computed_tokens
            if block_ids is None and (cut := self._cut(request.req_id, start, num_new, computed)):
                num_new, block_ids = cut, self._admit(request, computed, cut)
            if block_ids is None:
                if not running:  # nothing will ever free blocks for it (pinned prefixes hold them)
                    self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
                    self.capped.append(request)
                    continue
                freed = self._preempt_for(request, scheduled, made_room)
                if freed is None:
                    break
                room += freed
                continue
            fair.pop(request)
            is_new = request.status == RequestStatus.WAITING
            if is_new:
                request.num_cached_tokens = computed.num_computed_tokens
                request.first_scheduled_time = time.perf_counter()
            else:
                self._end_preemption(request)
            if self.events is not None:
                self.events.append(("scheduled" if is_new else "resumed", request))
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed.num_computed_tokens
            bisect.insort(running, request, key=fair.order)
            scheduled.append(self._schedule(request, num_new, block_ids))
            room -= num_new

        requests = self.requests
        fair.charge((requests[s.req_id], s.num_tokens) for s in scheduled)
        finished, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(scheduled=scheduled, finished_req_ids=finished)

    def prompt_room(self, num_decode_tokens: int) -> int:
        """Prompt tokens a step with ``num_decode_tokens`` may take: what keeps its predicted time within
        ``step_time_target``, or within twice the decodes' own time where that is longer (prompts then
        keep half the step: prefill never slows to a crawl behind a large batch), ``MIN_PROMPT_TOKENS``
        at least; the whole budget where no decode runs, no target is set, or no step was measured yet."""
        budget = self.max_num_batched_tokens
        decode_seconds = self.step_cost.predict(num_decode_tokens, 0)
        if not num_decode_tokens or self.step_time_target is None or decode_seconds is None:
            return budget
        seconds = max(self.step_time_target, PROMPT_SHARE_OF_STEP * decode_seconds)
        room = self.step_cost.prompt_tokens_within(seconds, num_decode_tokens)
        return budget if room is None else min(budget, max(room, MIN_PROMPT_TOKENS))

    def record_step(self, output: SchedulerOutput, seconds: float) -> None:
        """Feeds a computed step's time to ``step_cost`` (rows with logits are decode tokens, the rest prompt)."""
        num_logits = output.num_logits
        self.step_cost.observe(num_logits, output.total_num_scheduled_tokens - num_logits, seconds)

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

    def rollback_drafts(self, scheduled: Iterable[ScheduledRequest]) -> None:
        """After a step's drafts were verified: uncounts the rejected ones and frees their slots.

        A running request that took ``a`` of its ``d`` drafts (plus one token of its own) keeps
        the K/V of its first ``num_tokens - 1`` tokens; the ``d - a`` rejected drafts' slots are
        overwritten by the next step, and blocks past them go back to the pool.
        """
        for share in scheduled:
            if not share.num_draft_tokens:
                continue
            request = self.requests.get(share.req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished in this step: its blocks are freed already
            num_computed = request.num_tokens - 1
            if request.num_computed_tokens > num_computed:
                request.num_computed_tokens = num_computed
                self.kv.free_tail(request.req_id, num_computed)

    def _schedule_decodes(
        self, scheduled: list[ScheduledRequest], budget: int, cap: int, in_flight: Collection[str]
    ) -> tuple[bool, int]:
        """Gives every running decode its token (and drafts), front to back, ``cap`` requests at most; short of
        blocks, the back of the running list is preempted (one in a step in flight too: its blocks go back now, which
        is safe as every stage runs the steps in order, and its step's logits are dropped when they come back).
        Returns whether any was preempted, and the budget left."""
        running = self.running
        allocate_slots = self.kv.allocate_slots
        num_behind = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        # NOTE: drafts are weighed at the batch the step heads to (every running and waiting request, up to
        # max_num_seqs): while prompts wait, they would take the budget the admissions need.
        num_rows = min(len(running) + self.fair.num_waiting, self.max_num_seqs)
        draining = not self.fair.num_waiting
        preempted = False
        i = 0
        while i < len(running) and budget > 0 and len(scheduled) < cap:
            request = running[i]
            token_ids = request.all_token_ids
            start = request.num_computed_tokens
            if len(token_ids) - start != 1 or request.req_id in in_flight:  # NOTE: a prompt's last token may be 1
                i += 1
                continue
            num_behind -= 1
            # NOTE: drafts leave one token of budget to every decode behind.
            drafts = self._drafts(request, budget - num_behind, num_rows, draining) if self.propose is not None else ()
            num_new = 1 + len(drafts)
            block_ids = allocate_slots(request.req_id, token_ids, start, num_new, cache_salt=request.cache_salt)
            if block_ids is None and drafts:  # NOTE: drafts never preempt another request
                drafts, num_new = (), 1
                block_ids = allocate_slots(request.req_id, token_ids, start, 1, cache_salt=request.cache_salt)
            while block_ids is None:
                victim = running.pop()
                if victim is request and not running:
                    # Alone and still short: the cache cannot hold this request any longer.
                    self._finish(victim, RequestStatus.FINISHED_LENGTH_CAPPED)
                    self.capped.append(victim)
                    break
                num_behind -= victim is not request and victim.num_tokens - victim.num_computed_tokens == 1
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                block_ids = allocate_slots(request.req_id, token_ids, start, num_new, cache_salt=request.cache_salt)
            if block_ids is None:
                continue  # ``request`` left the running list; nothing behind it remains
            request.num_computed_tokens = start + num_new
            scheduled.append(ScheduledRequest(request.req_id, [token_ids[-1], *drafts], start, block_ids, True, len(drafts)))
            budget -= num_new
            i += 1
        return preempted, budget

    def _drafts(self, request: Request, max_num_tokens: int, num_rows: int, draining: bool) -> Sequence[int]:
        """The drafts to verify after ``request``'s next token: ``max_num_tokens`` in all at most, within
        ``max_tokens`` and the length cap."""
        room = max_num_tokens - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        if request.max_num_tokens is not None:
            room = min(room, request.max_num_tokens - request.num_tokens - 1)
        return self.propose(request, room, num_rows, draining) if room > 0 else ()  # type: ignore[misc]

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

    def _encoder_cut(self, request: Request, start: int, num_new: int) -> int:
        """``num_new`` cut before the first image the step's encoder budget cannot take (``EncoderBudget.cut``)."""
        if self.encoder_budget is None or not request.mm_spans or num_new <= 0:
            return num_new
        return self.encoder_budget.cut(request.mm_spans, start, num_new)

    def _cut(self, req_id: str, start: int, num_new: int, computed: ComputedBlocks | None = None) -> int:
        """A shorter prefill chunk the cache can hold now where the whole one did not fit: with sliding-window
        groups, which release blocks as the prompt advances, later chunks reuse what earlier ones free, so
        a cut chunk goes on instead of preempting or refusing; 0 without such groups (full attention needs
        every block in the end, so a chunk preempts for its room as before) or where not one block fits."""
        if not self.kv.has_sliding_groups:
            return 0
        return self.kv.num_tokens_that_fit(req_id, start, num_new, computed)

    def _admit(self, request: Request, computed: ComputedBlocks, num_new: int) -> BlockTables | None:
        return self.kv.allocate_slots(
            request.req_id, request.all_token_ids, computed.num_computed_tokens, num_new, computed=computed,
            cache_salt=request.cache_salt, mm_spans=request.mm_spans,
        )

    def _allocate(self, request: Request, num_new: int) -> BlockTables | None:
        return self.kv.allocate_slots(
            request.req_id, request.all_token_ids, request.num_computed_tokens, num_new,
            cache_salt=request.cache_salt, mm_spans=request.mm_spans,
        )

    def _schedule(self, request: Request, num_new: int, block_ids: BlockTables) -> ScheduledRequest:
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
            images=request.images if start < request.num_prompt_tokens else (),
        )

    def _preempt_for(self, request: Request, scheduled: list[ScheduledRequest], made_room: set[str]) -> int | None:
        """Preempts a running request to make room for ``request``, if one may go.

        The victim is the last running request when ``request`` has a strictly better
        priority, else the one ``FairShare.victim_for`` names. Its share of this step, if it
        had one, is taken back out of ``scheduled``; its id is added to ``made_room``.

        Returns:
            The budget tokens given back, or None when no running request may go.
        """
        running = self.running
        if not running:
            return None
        if running[-1].priority > request.priority:
            victim = running.pop()
        else:
            victim = self.fair.victim_for(request, running)
            if victim is None:
                return None
            running.remove(victim)
        freed = self._take_back(victim, scheduled)
        self._preempt(victim)
        made_room.add(victim.req_id)
        return freed

    def _take_back(self, victim: Request, scheduled: list[ScheduledRequest]) -> int:
        """Removes ``victim``'s share of this step from ``scheduled``, if it had one; returns its tokens."""
        for i in range(len(scheduled) - 1, -1, -1):
            share = scheduled[i]
            if share.req_id == victim.req_id:
                del scheduled[i]
                end = share.num_computed_tokens + share.num_tokens
                if share.num_computed_tokens < victim.num_prompt_tokens:
                    self.num_prompt_tokens_computed -= min(end, victim.num_prompt_tokens) - share.num_computed_tokens
                return share.num_tokens
        return 0

    def _preempt(self, request: Request) -> None:
        logger.debug("preempt %s", request.req_id)
        self.kv.free(request.req_id)
        self.fair.run_stopped(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.preempted_at = time.perf_counter()
        self.num_preemptions += 1
        self.fair.push(request)
        if self.events is not None:
            self.events.append(("preempted", request))

    @staticmethod
    def _end_preemption(request: Request) -> None:
        if request.preempted_at is not None:
            request.preempted_seconds += time.perf_counter() - request.preempted_at
            request.preempted_at = None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.fair.run_stopped(request)
        elif request.status == RequestStatus.PREEMPTED:
            self._end_preemption(request)
        self.fair.finish(request, was_queued=request.status in _QUEUED)
        request.status = status
        # NOTE: a pinned prefix that computed its prompt keeps its blocks (the engine unpins it);
        # aborted or failed, it holds nothing.
        if not (request.keep_blocks and status in _KEEPS_BLOCKS):
            self.kv.free(request.req_id)
        self.requests.pop(request.req_id, None)
        self._finished_req_ids.add(request.req_id)
