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
    """Timing of one request, in seconds of ``time.perf_counter()``."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


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
