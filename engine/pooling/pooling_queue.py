"""PoolingQueue: pooling requests waiting, run a token-budget batch a step, each answered through its callback."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

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
# NOTE: tokens a pooling model beside a chat model runs a step: the engines of a process step in turn
# (engine.driver.STEP_LOCK), so a chat decode waits at most one batch this size for an embedding burst
# (measured on a loaded 2-core box: chat ITL p99 0.52-0.58 s against 0.88-1.28 s at 512 tokens)
SHARED_POOLING_BUDGET = 256

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


class PoolingQueue:
    """The waiting pooling requests; ``step`` runs the oldest ones that fit ``token_budget`` as one batch.

    Args:
        runner: runs a batch (``PoolingRunner.embed`` / ``.score``).
        token_budget: most tokens of one batch (at least one request runs, however long).
    """

    def __init__(self, runner, token_budget: int) -> None:
        self.runner = runner
        self.token_budget = token_budget
        self.stats = PoolingStats()
        self.waiting: deque[PoolingRequest] = deque()
        self._ids = itertools.count()

    def next_id(self) -> str:
        return str(next(self._ids))

    def add(self, request: PoolingRequest) -> None:
        self.waiting.append(request)

    def share_steps(self) -> None:
        """Run ``SHARED_POOLING_BUDGET`` tokens a step from now on: the engine serves beside a chat model."""
        self.token_budget = SHARED_POOLING_BUDGET

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def step(self) -> int:
        """Runs one batch of the kind at the head of the queue; returns the requests answered (failed ones too)."""
        if not self.waiting:
            return 0
        kind = self.waiting[0].kind
        batch: list[PoolingRequest] = []
        rest: deque[PoolingRequest] = deque()
        num_tokens = 0
        for request in self.waiting:
            size = len(request.input.token_ids)
            if request.kind == kind and (not batch or num_tokens + size <= self.token_budget):
                batch.append(request)
                num_tokens += size
            else:
                rest.append(request)
        self.waiting = rest
        self._run(kind, batch)
        return len(batch)

    def _run(self, kind: str, batch: list[PoolingRequest]) -> None:
        ordered = sorted(batch, key=lambda r: len(r.input.token_ids), reverse=True)  # least padding in attention
        inputs = [r.input for r in ordered]
        params = [r.params for r in ordered]
        started = time.monotonic()
        try:
            values = self.runner.embed(inputs, params) if kind == "embed" else self.runner.score(inputs, params)
        except Exception as e:  # NOTE: a failed batch fails its requests; the engine serves on
            logger.exception("pooling batch of %d requests failed", len(batch))
            for request in ordered:
                request.on_done(EngineError(f"pooling request {request.request_id} failed: {e}"))
            return
        finally:
            waited = [started - r.arrival_time for r in ordered]
            self.stats.observe_batch(kind, waited, sum(len(i.token_ids) for i in inputs), time.monotonic() - started)
        for request, value in zip(ordered, values):
            ids = request.input.token_ids
            if kind == "embed":
                request.on_done(EmbeddingRequestOutput(request.request_id, ids, EmbeddingOutput(value)))
            else:
                request.on_done(ScoringRequestOutput(request.request_id, ids, ScoringOutput(value)))
