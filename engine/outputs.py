"""RequestOutput / CompletionOutput: the only objects that leave the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Logprob(NamedTuple):
    """One candidate token's log probability under the model (before sampling knobs)."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a prompt (``n`` > 1 gives several, told apart by ``index``).

    Text and token ids are cumulative: everything generated so far.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "content_filter"; None while running
    logprobs: list[dict[int, Logprob]] | None = None  # per token: sampled token + top-k candidates

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timing of one request, in seconds of ``time.perf_counter()``, and where its prompt's KV came from.

    The phases split the request's life: queue (arrival to first scheduled), prefill (to the
    first token), decode (to the finish); ``preempted_seconds`` is the part of prefill and
    decode spent preempted, waiting to be readmitted. A phase a request never reached
    (aborted while queued, say) is None.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    preempted_seconds: float = 0.0
    num_computed_prompt_tokens: int = 0  # prompt tokens the model computed at first admission
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache instead

    @property
    def ttft(self) -> float | None:
        return _span(self.arrival_time, self.first_token_time)

    @property
    def time_in_queue(self) -> float | None:
        return _span(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_time(self) -> float | None:
        return _span(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _span(self.first_token_time, self.finished_time)

    @property
    def e2e_latency(self) -> float | None:
        return _span(self.arrival_time, self.finished_time)


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step: cumulative completions, ``finished`` on the last."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class PinnedPrefix:
    """A prompt prefix whose full KV blocks stay referenced until ``unpin_prefix(pin_id)``."""

    pin_id: str
    num_tokens: int  # tokens of the pinned prompt
    num_cached_tokens: int  # of those, found already cached when pinning (not recomputed)
