"""PoolingQueue: pooling requests waiting, run a token-budget batch a step, each answered through its callback."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, Union

from engine.chat_pace import CHAT_PACE, ChatPace
from engine.errors import EngineError
from engine.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput
from engine.pooling.params import PoolingParams
from engine.pooling.pooling_stats import PoolingStats
from engine.pooling.tokens import PoolingInput

logger = logging.getLogger(__name__)

# most tokens of one pooling batch by device (or the step's budget, if larger). On CPU, big enough that a batch's
# matmuls run at the CPU's pace and small enough that its activations stay in cache: MiniLM on a 2-vCPU Zen 5 ran
# 200-token chunks 1.2x faster in batches of 4-12 than of 40 (8192 tokens), in bfloat16 and in float32 alike.
POOLING_TOKEN_BUDGET = {"cpu": 2048, "cuda": 8192}
# NOTE: most tokens of a batch a pooling model beside a chat model starts while the chat model has requests; its
# turns between two chat steps are bounded by time (PoolingQueue.share_steps), a layer of the batch at a time
SHARED_POOLING_BUDGET = 256
COST_SMOOTHING = 0.5  # weight of the latest layer's time in the measured seconds per token and layer

PoolingResult = Union[EmbeddingRequestOutput, ScoringRequestOutput]


@dataclass(slots=True)
class PoolingRequest:
    """One input to embed ("embed") or one pair to score ("score"); ``on_done`` gets its output or its error."""

    request_id: str
    kind: str
    input: PoolingInput
    params: PoolingParams
    on_done: Callable[[PoolingResult | EngineError], None]
    arrival_time: float = field(default_factory=time.monotonic)  # when the caller asked (its queue time starts)


class BatchRun(Protocol):
    """A batch set up by the runner (``PoolingRunner.start``), run a layer at a time."""

    num_stages: int

    @property
    def done(self) -> bool: ...

    def advance(self) -> None: ...

    def values(self) -> list: ...


@dataclass(slots=True)
class _Running:
    """A batch between two of its layers: its requests (the runner's order), its run, when it started, its seconds."""

    kind: str
    requests: list[PoolingRequest]
    run: BatchRun | None  # None only for a batch that failed to start
    num_tokens: int
    started: float
    compute_s: float = 0.0


class PoolingQueue:
    """The waiting pooling requests; ``step`` runs the oldest ones that fit the token budget as one batch.

    Alone, a step runs a whole batch of ``token_budget`` tokens. Beside a chat model (``share_steps``), while a
    chat engine of the process has requests, a step (its turn between two chat steps) runs the batch's layers for
    at most ``ChatPace.turn_seconds()`` (the chat engine's ``pooling_time_fraction`` of its measured step time)
    and leaves the rest for its next turns; one layer at least, so the batch always progresses. Such a batch
    takes at most ``SHARED_POOLING_BUDGET`` tokens, fewer where the measured seconds per token and layer say
    one layer of it would not fit the turn (one input at least).

    Args:
        runner: ``start(kind, inputs, params)`` sets up a batch (``PoolingRunner.start``).
        token_budget: most tokens of one batch (at least one request runs, however long).
    """

    def __init__(self, runner, token_budget: int) -> None:
        self.runner = runner
        self.token_budget = token_budget
        self.stats = PoolingStats()
        self.waiting: deque[PoolingRequest] = deque()
        self.pace: ChatPace | None = None  # set by share_steps(): the chat engines this queue yields to
        self.seconds_per_token_layer: float | None = None  # measured, smoothed
        self._running: _Running | None = None
        self._ids = itertools.count()

    def next_id(self) -> str:
        return str(next(self._ids))

    def add(self, request: PoolingRequest) -> None:
        self.waiting.append(request)

    def share_steps(self, pace: ChatPace | None = None) -> None:
        """Yield to the chat engines of ``pace`` (the process's, ``CHAT_PACE``, by default) from now on."""
        self.pace = CHAT_PACE if pace is None else pace

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self._running is not None

    def turn_seconds(self) -> float | None:
        """How long this step may run: None (a whole batch) alone or while no chat engine has requests."""
        return None if self.pace is None else self.pace.turn_seconds()

    def batch_budget(self, turn_s: float | None) -> int:
        """Most tokens of the next batch: ``token_budget`` with no bound; beside a chat model's requests, the
        tokens one layer of which fits ``turn_s`` by the measured cost, at most ``SHARED_POOLING_BUDGET``."""
        if turn_s is None:
            return self.token_budget
        budget = min(self.token_budget, SHARED_POOLING_BUDGET)
        if self.seconds_per_token_layer is not None:
            budget = min(budget, int(turn_s / self.seconds_per_token_layer))
        return budget  # NOTE: 0 still takes the head request (a batch holds one at least)

    def step(self) -> int:
        """Runs a batch's layers (a new batch of the kind at the head of the queue when none is half-run) for
        this turn; returns the requests answered (failed ones too): 0 while the batch is unfinished."""
        turn_started = time.monotonic()
        turn_s = self.turn_seconds()
        if self._running is None:
            if not self.waiting:
                return 0
            self._running = self._start(self.batch_budget(turn_s))
            if self._running is None:
                return 0
        running = self._running
        try:
            while not running.run.done:
                started = time.monotonic()
                running.run.advance()
                layer_s = time.monotonic() - started
                running.compute_s += layer_s
                self._observe_layer(running.num_tokens, layer_s)
                if running.run.done:
                    break
                turn_s = self.turn_seconds()
                if turn_s is not None and time.monotonic() - turn_started + layer_s > turn_s:
                    return 0  # NOTE: the next layer would overrun the turn: it runs in the next one
            started = time.monotonic()
            values = running.run.values()
            running.compute_s += time.monotonic() - started
        except Exception as e:  # NOTE: a failed batch fails its requests; the engine serves on
            self._finish(running)
            logger.exception("pooling batch of %d requests failed", len(running.requests))
            for request in running.requests:
                request.on_done(EngineError(f"pooling request {request.request_id} failed: {e}"))
            return len(running.requests)
        self._finish(running)
        for request, value in zip(running.requests, values):
            ids = request.input.token_ids
            if running.kind == "embed":
                request.on_done(EmbeddingRequestOutput(request.request_id, ids, EmbeddingOutput(value)))
            else:
                request.on_done(ScoringRequestOutput(request.request_id, ids, ScoringOutput(value)))
        return len(running.requests)

    def _start(self, token_budget: int) -> _Running | None:
        kind = self.waiting[0].kind
        batch: list[PoolingRequest] = []
        rest: deque[PoolingRequest] = deque()
        num_tokens = 0
        for request in self.waiting:
            size = len(request.input.token_ids)
            if request.kind == kind and (not batch or num_tokens + size <= token_budget):
                batch.append(request)
                num_tokens += size
            else:
                rest.append(request)
        self.waiting = rest
        ordered = sorted(batch, key=lambda r: len(r.input.token_ids), reverse=True)  # least padding in attention
        started = time.monotonic()
        try:
            run = self.runner.start(kind, [r.input for r in ordered], [r.params for r in ordered])
        except Exception as e:  # NOTE: as a failed layer: its requests fail, the engine serves on
            logger.exception("pooling batch of %d requests failed", len(batch))
            self._finish(_Running(kind, ordered, None, num_tokens, started, time.monotonic() - started))
            for request in ordered:
                request.on_done(EngineError(f"pooling request {request.request_id} failed: {e}"))
            return None
        return _Running(kind, ordered, run, num_tokens, started, time.monotonic() - started)

    def _observe_layer(self, num_tokens: int, seconds: float) -> None:
        cost = seconds / max(num_tokens, 1)
        previous = self.seconds_per_token_layer
        self.seconds_per_token_layer = cost if previous is None else previous + COST_SMOOTHING * (cost - previous)

    def _finish(self, running: _Running) -> None:
        self._running = None
        waited = [running.started - r.arrival_time for r in running.requests]
        self.stats.observe_batch(running.kind, waited, running.num_tokens, running.compute_s)
