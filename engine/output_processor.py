"""OutputProcessor: sampled tokens -> per-request state changes -> RequestOutputs.

After the scheduler has appended a step's sampled tokens, the processor records their
latencies and logprobs, runs the detokenizer (which finds stop strings) and builds the
cumulative ``RequestOutput`` of a user request from its ``n`` sibling sequences.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.core.scheduler import Scheduler
from engine.detokenizer import IncrementalDetokenizer, make_decode_fn
from engine.errors import EngineError
from engine.metrics import Histogram
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ParentRequest:
    """One user request: its ``n`` sibling sequences share the prompt."""

    request_id: str
    prompt_token_ids: list[int]
    children: list[Request]

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


class OutputProcessor:
    """Turns the tokens sampled in a step into request state and outputs; owns the latency figures.

    Args:
        scheduler: Told when a stop string finishes a request.
        tokenizer: Decodes output text and logprob tokens.
    """

    def __init__(self, scheduler: Scheduler, tokenizer: Any) -> None:
        self.scheduler = scheduler
        self.decode = make_decode_fn(tokenizer)
        self.ttft = Histogram()
        self.itl = Histogram()
        self.num_generation_tokens = 0

    def add_request(self, request: Request) -> None:
        """Gives a new sequence the detokenizer that follows its text and stop strings."""
        request.detokenizer = IncrementalDetokenizer(self.decode, request.prompt_token_ids, request.sampling_params.stop)

    def process(
        self,
        rows: list[Request],
        logprobs: list[list | None],
        touched: dict[str, None],
        fail: Callable[[str, EngineError], None],
    ) -> None:
        """Records one sampled token per row (already appended by the scheduler).

        Args:
            rows: The requests that got a token, in sampling order.
            logprobs: Per row, the sampler's ``(token, logprob, rank)`` list, or None.
            touched: Parent ids whose output changed; each row's parent is added.
            fail: ``fail(parent_id, error)`` fails a request whose postprocessing raised.
        """
        now = time.perf_counter()
        self.num_generation_tokens += len(rows)
        for request, row_logprobs in zip(rows, logprobs):
            touched[request.parent_id] = None
            try:
                self._postprocess(request, row_logprobs, now)
            except Exception as exc:
                logger.exception("postprocessing %s failed", request.req_id)
                fail(request.parent_id, EngineError(f"postprocessing failed: {exc!r}"))

    def _postprocess(self, request: Request, row_logprobs: list | None, now: float) -> None:
        if request.first_token_time is None:
            request.first_token_time = now
            self.ttft.observe(now - request.arrival_time)
        else:
            self.itl.observe(now - request.last_token_time)
        request.last_token_time = now
        if row_logprobs is not None and request.logprobs is not None:
            entry: dict[int, Logprob] = {}
            for tok, lp, rank in row_logprobs:  # the sampled token first, then the top k
                if tok not in entry:
                    entry[tok] = Logprob(lp, rank, self.decode([tok]))
            request.logprobs.append(entry)
        if request.status == RequestStatus.FINISHED_STOPPED:
            return  # ended by a stop token id / EOS: its text is not part of the output
        check_stop = request.num_output_tokens >= request.sampling_params.min_tokens
        if request.detokenizer.update(request.all_token_ids, check_stop):
            if request.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([request.req_id], RequestStatus.FINISHED_STOPPED)

    def make_output(self, parent: ParentRequest) -> RequestOutput:
        """The cumulative output of a user request: one completion per sibling, in index order."""
        finished = parent.finished
        completions = []
        for child in parent.children:
            child_finished = child.is_finished
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=child.detokenizer.visible_text(child_finished),
                    token_ids=child.output_token_ids,
                    finish_reason=child.status.finish_reason,
                    logprobs=list(child.logprobs) if child.logprobs is not None else None,
                )
            )
        first = parent.children[0]
        return RequestOutput(
            request_id=parent.request_id,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=first.arrival_time,
                first_token_time=min((c.first_token_time for c in parent.children if c.first_token_time), default=None),
                last_token_time=max((c.last_token_time for c in parent.children if c.last_token_time), default=None),
                finished_time=time.perf_counter() if finished else None,
            ),
        )
