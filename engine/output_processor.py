"""OutputProcessor: sampled tokens -> text, stop strings, logprobs, latencies -> Deltas and RequestOutputs.

Before the scheduler appends a step's sampled tokens, the processor decodes them (finding
stop strings), records their logprobs and latencies, and tells the scheduler which
requests reached a stop string. After the step it turns what each user request gained into
``Delta``s (one per completion that progressed: its new tokens, text and logprobs), or, for
the cumulative API, into a ``RequestOutput`` built from everything recorded. What it keeps
per sequence lives in its own table, never on the ``Request``.

NOTE: nothing here copies a sequence's output per step: a delta slices only the new tail of
its token list and logprobs, and the detokenizer hands out new text only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import IncrementalDetokenizer, make_decode_fn
from engine.errors import EngineError
from engine.metrics import Histogram
from engine.outputs import (
    CompletionOutput, Delta, Logprob, Received, RequestLatency, RequestMetrics, RequestOutput, TokenLogprob, TopLogprob, Usage,
)
from engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ParentRequest:
    """One user request: its ``n`` sibling sequences share the prompt."""

    request_id: str
    prompt_token_ids: list[int]
    children: list[Request]
    sent_prompt: bool = False  # its first delta (which carries the prompt ids) was made

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


@dataclass(slots=True)
class _SequenceOutput:
    """What the processor keeps of one sequence: its text, logprobs, token times and what its deltas sent."""

    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_sent_tokens: int = 0  # output tokens (and logprobs) already in a delta
    finish_sent: bool = False  # its last delta was made
    entries: list[dict[int, Logprob]] = field(default_factory=list)  # logprobs as CompletionOutput gives them


class OutputProcessor:
    """Turns the tokens sampled in a step into text, deltas and outputs; owns the latency figures.

    Args:
        tokenizer: Decodes output text and logprob tokens.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.decode = make_decode_fn(tokenizer)
        self.ttft = Histogram()
        self.itl = Histogram()
        self.num_generation_tokens = 0
        self._sequences: dict[str, _SequenceOutput] = {}

    def add_request(self, request: Request, received: Received | None = None) -> None:
        """Starts following a new sequence's text and stop strings.

        With ``received``, what its caller already got of an earlier run: those tokens are
        replayed into its text and counted as sent, so its deltas go on from there.
        """
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(self.decode, request.prompt_token_ids, params.stop)
        sequence = _SequenceOutput(detokenizer, [] if params.logprobs is not None else None)
        self._sequences[request.req_id] = sequence
        if received is None or not received.token_ids:
            return
        for num_output, token_id in enumerate(received.token_ids, 1):
            detokenizer.update((token_id,), num_output >= params.min_tokens)
        detokenizer.take(False)  # NOTE: the text its caller got: held-back text is a function of the tokens
        sequence.num_sent_tokens = len(received.token_ids)
        if sequence.logprobs is not None and received.logprobs is not None:
            sequence.logprobs.extend(received.logprobs)
        sequence.first_token_time = sequence.last_token_time = time.perf_counter()

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
            sequence.logprobs.append(self._token_logprob(row_logprobs))
        num_output = request.num_output_tokens + 1
        if request.is_stop_token(token_id, num_output):
            return False  # it ends the request; its text is not part of the output
        check_stop = num_output >= request.sampling_params.min_tokens
        return sequence.detokenizer.update((token_id,), check_stop)

    def _token_logprob(self, row_logprobs: list) -> TokenLogprob:
        """The sampler's row (the sampled token, then the top k by rank) as a ``TokenLogprob``."""
        (token_id, logprob, rank), *top = row_logprobs
        decoded = {tok: self.decode([tok]) for tok, _, _ in row_logprobs}
        return TokenLogprob(
            token=decoded[token_id],
            logprob=logprob,
            top_logprobs=[TopLogprob(decoded[tok], lp, tok, r) for tok, lp, r in top],
            token_id=token_id,
            rank=rank,
        )

    def deltas(self, parent: ParentRequest, metrics: RequestMetrics | None = None) -> list[Delta]:
        """What each completion of ``parent`` gained since its previous delta, one delta per completion that did.

        The request's first delta carries its prompt ids; once it finished, its last delta
        carries its usage, with the latency of ``metrics`` (its final ``metrics()``).
        """
        deltas = []
        for child in parent.children:
            sequence = self._sequences[child.req_id]
            if sequence.finish_sent:
                continue
            finish_reason = child.status.finish_reason
            start = child.num_prompt_tokens + sequence.num_sent_tokens
            token_ids = child.all_token_ids[start:]
            text = sequence.detokenizer.take(finish_reason is not None)
            if not (token_ids or text or finish_reason):
                continue
            logprobs = None
            if sequence.logprobs is not None:
                # NOTE: aligned with the output tokens by position; a trailing stop token has one too.
                logprobs = sequence.logprobs[sequence.num_sent_tokens : sequence.num_sent_tokens + len(token_ids)]
            sequence.num_sent_tokens += len(token_ids)
            sequence.finish_sent = finish_reason is not None
            deltas.append(Delta(parent.request_id, child.index, text, token_ids, logprobs, finish_reason))
        if deltas:
            if not parent.sent_prompt:
                parent.sent_prompt = True
                deltas[0].prompt_token_ids = parent.prompt_token_ids
                deltas[0].num_cached_tokens = parent.children[0].num_cached_tokens
            if parent.finished:
                deltas[-1].usage = Usage(
                    prompt_tokens=len(parent.prompt_token_ids),
                    completion_tokens=sum(c.num_output_tokens for c in parent.children),
                    cached_tokens=parent.children[0].num_cached_tokens,
                    latency=RequestLatency.of(metrics or self.metrics(parent)),
                )
        return deltas

    def make_output(self, parent: ParentRequest, metrics: RequestMetrics | None = None) -> RequestOutput:
        """The cumulative output of a user request: one completion per sibling, in index order.

        It copies everything recorded (O(output length)): the cumulative API's cost, paid per
        call; streaming goes through ``deltas``.
        """
        completions = []
        for child in parent.children:
            sequence = self._sequences[child.req_id]
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=sequence.detokenizer.visible_text(child.is_finished),
                    token_ids=child.output_token_ids,
                    finish_reason=child.status.finish_reason,
                    logprobs=self._entries(sequence),
                )
            )
        return RequestOutput(
            request_id=parent.request_id,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            num_cached_tokens=parent.children[0].num_cached_tokens,
            metrics=metrics or self.metrics(parent),
        )

    @staticmethod
    def _entries(sequence: _SequenceOutput) -> list[dict[int, Logprob]] | None:
        if sequence.logprobs is None:
            return None
        entries = sequence.entries
        entries.extend(lp.as_entry() for lp in sequence.logprobs[len(entries) :])
        return list(entries)

    def metrics(self, parent: ParentRequest) -> RequestMetrics:
        """The request's timing so far (``finished_time`` once it finished)."""
        children = parent.children
        sequences = [self._sequences[child.req_id] for child in children]
        first = children[0]
        scheduled = [c.first_scheduled_time for c in children if c.first_scheduled_time is not None]
        num_cached = first.num_cached_tokens if scheduled else 0
        return RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=min(scheduled, default=None),
            first_token_time=min((s.first_token_time for s in sequences if s.first_token_time), default=None),
            last_token_time=max((s.last_token_time for s in sequences if s.last_token_time), default=None),
            finished_time=time.perf_counter() if parent.finished else None,
            preempted_seconds=max(c.preempted_seconds for c in children),
            num_computed_prompt_tokens=len(parent.prompt_token_ids) - num_cached if scheduled else 0,
            num_cached_prompt_tokens=num_cached,
        )
