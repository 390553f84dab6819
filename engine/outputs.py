"""What leaves the engine: per-step ``Delta``s, and cumulative ``RequestOutput``s built from them.

A ``Delta`` is the new output of one completion since its previous delta; it is the one
streaming type of the whole stack (the SDK's transports, client, hooks, server and framework
adapters pass the same objects on). ``RequestOutput`` / ``CompletionOutput`` are the
cumulative view ``Engine.generate`` and ``Engine.step`` return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


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


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One candidate token at a position and its log probability.

    ``token_id`` and ``rank`` are the engine's; a logprob read from an OpenAI-format server has
    neither, and equals the engine's of the same token and value.
    """

    token: str
    logprob: float
    token_id: int | None = field(default=None, compare=False)
    rank: int | None = field(default=None, compare=False)  # 1 = the most likely token


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log probability and the most likely candidates at its position."""

    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = field(default_factory=list)
    """Most likely first; as many as the request's ``logprobs`` asked for."""
    token_id: int | None = field(default=None, compare=False)  # as TopLogprob's
    rank: int | None = field(default=None, compare=False)

    def as_entry(self) -> dict[int, Logprob]:
        """The ``CompletionOutput.logprobs`` entry: the sampled token first, then the candidates, by id."""
        assert self.token_id is not None and self.rank is not None
        entry = {self.token_id: Logprob(self.logprob, self.rank, self.token)}
        for top in self.top_logprobs:
            assert top.token_id is not None and top.rank is not None
            entry.setdefault(top.token_id, Logprob(top.logprob, top.rank, top.token))
        return entry


@dataclass(frozen=True, slots=True)
class RequestLatency:
    """Where one request's time went, by the engine's clock, and where its prompt's KV came from.

    ``queue_s + prefill_s + decode_s == e2e_s``; ``preempted_s`` is the part of prefill and
    decode the request spent preempted. A phase the request never reached is None.
    """

    e2e_s: float | None = None
    """Arrival in the engine to finish."""
    queue_s: float | None = None
    """Arrival to first scheduled."""
    prefill_s: float | None = None
    """First scheduled to first token."""
    decode_s: float | None = None
    """First token to finish."""
    preempted_s: float = 0.0
    computed_prompt_tokens: int = 0
    """Prompt tokens the model computed."""
    cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache instead."""

    @classmethod
    def of(cls, metrics: RequestMetrics) -> RequestLatency:
        """The durations of a finished request's ``RequestMetrics``."""
        return cls(
            e2e_s=metrics.e2e_latency,
            queue_s=metrics.time_in_queue,
            prefill_s=metrics.prefill_time,
            decode_s=metrics.decode_time,
            preempted_s=metrics.preempted_seconds,
            computed_prompt_tokens=metrics.num_computed_prompt_tokens,
            cached_prompt_tokens=metrics.num_cached_prompt_tokens,
        )


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request (over its ``n`` completions)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (not recomputed)."""
    latency: RequestLatency | None = None
    """The engine's breakdown of the request's time, once it finished there; None before, or
    over a transport whose server does not report it."""
    total_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_tokens", self.prompt_tokens + self.completion_tokens)


@dataclass(slots=True)
class Received:
    """What a caller has received of a request's one completion: where a resumed run goes on from.

    Attributes:
        token_ids: the output tokens its deltas carried, in order.
        logprobs: theirs, one per token, when the request set ``logprobs``.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None

    def add(self, delta: Delta) -> None:
        """Records one more delta of the completion."""
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)


@dataclass(slots=True)
class Delta:
    """New output of one completion of a request since its previous delta.

    The engine makes them, one per completion that progressed in a step; the SDK's transports,
    client and hooks, the server and the framework adapters pass the same objects on (the SDK
    fills ``reasoning`` and ``tool_calls``, parsed out of the text). Each completion's last delta has its
    ``finish_reason``; the request's very last delta, and only that one, has ``usage``.
    """

    request_id: str
    index: int = 0
    """Which of the request's ``n`` completions this continues."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    """One per token of ``token_ids``, when the request set ``logprobs``."""
    finish_reason: str | None = None
    """"stop" | "length" | "abort" | "content_filter" | "tool_calls"; None until the completion's last delta."""
    prompt_token_ids: list[int] | None = None
    """The prompt as the engine tokenized it; on a request's first delta only."""
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache; on a request's first delta only, where known."""
    usage: Usage | None = None
    """The request's totals; on its last delta only (every completion finished)."""
    tool_calls: list[Any] | None = None
    """New output of the reply's tool calls (``sdk.tools.ToolCallDelta``s: a call's id and name
    first, then argument fragments); the SDK sets it, never the engine."""
    reasoning: str = ""
    """New reasoning text of a thinking model's reply, apart from ``text`` (``sdk.reasoning``);
    the SDK sets it, never the engine."""


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


class OutputAccumulator:
    """A request's cumulative ``RequestOutput``, built from its deltas.

    ``output()`` copies what was added (O(output length)): the cost of the cumulative view,
    paid only by those who ask for it. ``metrics`` stays None: a delta carries the latency
    breakdown (``usage.latency``), not the engine's clock readings.

    Args:
        n: The request's number of completions.
        logprobs: Whether its deltas carry logprobs.
    """

    def __init__(self, n: int = 1, logprobs: bool = False) -> None:
        self._request_id = ""
        self._prompt_token_ids: list[int] = []
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._token_ids: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[dict[int, Logprob]]] | None = [[] for _ in range(n)] if logprobs else None
        self._finish_reasons: list[str | None] = [None] * n
        self._usage: Usage | None = None

    def add(self, delta: Delta) -> None:
        """Appends one delta of the request."""
        i = delta.index
        self._request_id = delta.request_id
        if delta.prompt_token_ids is not None:
            self._prompt_token_ids = delta.prompt_token_ids
        self._texts[i].append(delta.text)
        self._token_ids[i] += delta.token_ids
        if self._logprobs is not None and delta.logprobs is not None:
            self._logprobs[i] += (lp.as_entry() for lp in delta.logprobs)
        if delta.finish_reason is not None:
            self._finish_reasons[i] = delta.finish_reason
        if delta.usage is not None:
            self._usage = delta.usage

    def output(self) -> RequestOutput:
        """The request's output so far, as a new ``RequestOutput``."""
        completions = [
            CompletionOutput(
                index=i,
                text="".join(self._texts[i]),
                token_ids=list(self._token_ids[i]),
                finish_reason=self._finish_reasons[i],
                logprobs=None if self._logprobs is None else list(self._logprobs[i]),
            )
            for i in range(len(self._texts))
        ]
        return RequestOutput(
            request_id=self._request_id,
            prompt_token_ids=self._prompt_token_ids,
            outputs=completions,
            finished=self._usage is not None,
            num_cached_tokens=0 if self._usage is None else self._usage.cached_tokens,
        )
