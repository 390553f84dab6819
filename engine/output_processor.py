"""OutputProcessor: sampled tokens -> text, stop strings, logprobs, latencies -> RequestOutputs.

Before the scheduler appends a step's sampled tokens, the processor decodes them (finding
stop strings), records their logprobs and latencies, and tells the scheduler which
requests reached a stop string; it builds the cumulative ``RequestOutput`` of a user
request from its ``n`` sibling sequences. What it keeps per sequence lives in its own
table, never on the ``Request``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.detokenizer import IncrementalDetokenizer, make_decode_fn
from engine.errors import EngineError
from engine.metrics import Histogram
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.request import Request

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


@dataclass(slots=True)
class _SequenceOutput:
    """What the processor keeps of one sequence: its text so far, logprobs and token times."""

    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    first_token_time: float | None = None
    last_token_time: float | None = None


class OutputProcessor:
    """Turns the tokens sampled in a step into text and outputs; owns the latency figures.

    Args:
        tokenizer: Decodes output text and logprob tokens.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.decode = make_decode_fn(tokenizer)
        self.ttft = Histogram()
        self.itl = Histogram()
        self.num_generation_tokens = 0
        self._sequences: dict[str, _SequenceOutput] = {}

    def add_request(self, request: Request) -> None:
        """Starts following a new sequence's text and stop strings."""
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(self.decode, request.prompt_token_ids, params.stop)
        self._sequences[request.req_id] = _SequenceOutput(detokenizer, [] if params.logprobs is not None else None)

    def free(self, parent: ParentRequest) -> None:
        """Forgets a request whose final output was made."""
        for child in parent.children:
            self._sequences.pop(child.req_id, None)

    def process(
        self,
        rows: list[Request],
        token_ids: list[int],
        logprobs: list[list | None],
        touched: dict[str, None],
        fail: Callable[[str, EngineError], None],
    ) -> set[str]:
        """Records one sampled token per row, before the scheduler appends it.

        Args:
            rows: The requests that got a token, in sampling order.
            token_ids: The token sampled for each row.
            logprobs: Per row, the sampler's ``(token, logprob, rank)`` list, or None.
            touched: Parent ids whose output changed; each row's parent is added.
            fail: ``fail(parent_id, error)`` fails a request whose postprocessing raised.

        Returns:
            The ids of the rows whose text reached a stop string with this token.
        """
        now = time.perf_counter()
        self.num_generation_tokens += len(rows)
        stopped = set()
        for request, token_id, row_logprobs in zip(rows, token_ids, logprobs):
            touched[request.parent_id] = None
            try:
                if self._postprocess(request, token_id, row_logprobs, now):
                    stopped.add(request.req_id)
            except Exception as exc:
                logger.exception("postprocessing %s failed", request.req_id)
                fail(request.parent_id, EngineError(f"postprocessing failed: {exc!r}"))
        return stopped

    def _postprocess(self, request: Request, token_id: int, row_logprobs: list | None, now: float) -> bool:
        sequence = self._sequences[request.req_id]
        if sequence.first_token_time is None:
            sequence.first_token_time = now
            self.ttft.observe(now - request.arrival_time)
        else:
            self.itl.observe(now - sequence.last_token_time)
        sequence.last_token_time = now
        if row_logprobs is not None and sequence.logprobs is not None:
            entry: dict[int, Logprob] = {}
            for tok, lp, rank in row_logprobs:  # the sampled token first, then the top k
                if tok not in entry:
                    entry[tok] = Logprob(lp, rank, self.decode([tok]))
            sequence.logprobs.append(entry)
        num_output = request.num_output_tokens + 1
        if request.is_stop_token(token_id, num_output):
            return False  # it ends the request; its text is not part of the output
        check_stop = num_output >= request.sampling_params.min_tokens
        return sequence.detokenizer.update((token_id,), check_stop)

    def make_output(self, parent: ParentRequest) -> RequestOutput:
        """The cumulative output of a user request: one completion per sibling, in index order."""
        finished = parent.finished
        completions = []
        sequences = [self._sequences[child.req_id] for child in parent.children]
        for child, sequence in zip(parent.children, sequences):
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=sequence.detokenizer.visible_text(child.is_finished),
                    token_ids=child.output_token_ids,
                    finish_reason=child.status.finish_reason,
                    logprobs=list(sequence.logprobs) if sequence.logprobs is not None else None,
                )
            )
        first = parent.children[0]
        scheduled = [c.first_scheduled_time for c in parent.children if c.first_scheduled_time is not None]
        num_cached = first.num_cached_tokens if scheduled else 0
        return RequestOutput(
            request_id=parent.request_id,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=first.arrival_time,
                first_scheduled_time=min(scheduled, default=None),
                first_token_time=min((s.first_token_time for s in sequences if s.first_token_time), default=None),
                last_token_time=max((s.last_token_time for s in sequences if s.last_token_time), default=None),
                finished_time=time.perf_counter() if finished else None,
                preempted_seconds=max(c.preempted_seconds for c in parent.children),
                num_computed_prompt_tokens=len(parent.prompt_token_ids) - num_cached if scheduled else 0,
                num_cached_prompt_tokens=num_cached,
            ),
        )
