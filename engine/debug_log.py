"""The step log: one DEBUG line per engine step and per request transition, on ``engine.debug``.

A step line says what ran and where the time went::

    step 7: prefill=1 decode=3 tokens=41 | blocks +3 -0 evicted=0 free=58/64 | schedule 0.09 ms, forward+sample 6.20 ms, output 0.04 ms

and a lifecycle line follows a request: ``added``, ``scheduled`` (first admission, with its
cached prompt tokens), ``preempted``, ``resumed`` and ``finished`` (reason, tokens, phases).

Off by default. ``PAGED_DEBUG=1`` in the environment turns it on when an engine is made
(``configure_from_env``), as does any logging setup that enables DEBUG for ``engine.debug``
(``paged serve --log-level debug``). The engine checks ``is_enabled()`` once per step and
skips every call here when it is False, so the log costs nothing while off.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.block_pool import BlockPool
    from engine.core.scheduler_output import SchedulerOutput
    from engine.outputs import RequestMetrics
    from engine.request import Request

logger = logging.getLogger("engine.debug")

DEBUG_ENV = "PAGED_DEBUG"


def configure_from_env() -> None:
    """Turns the step log on when ``$PAGED_DEBUG`` is set to anything but empty or ``0``.

    With no logging configured at all, the lines go to stderr.
    """
    if os.environ.get(DEBUG_ENV, "") in ("", "0"):
        return
    logger.setLevel(logging.DEBUG)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def is_enabled() -> bool:
    return logger.isEnabledFor(logging.DEBUG)


class StepLog:
    """Writes the step and lifecycle lines of one engine; remembers the block counts of the last line.

    Args:
        pool: The engine's block pool, whose running totals give each step's block changes.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.num_steps = 0
        self._blocks = self._block_totals()

    def start(self) -> None:
        """The log turns on: block changes count from now."""
        self._blocks = self._block_totals()

    def _block_totals(self) -> tuple[int, int, int]:
        pool = self.pool
        return pool.num_allocated, pool.num_freed, pool.num_evictions

    def step(
        self,
        scheduler_output: SchedulerOutput,
        requests: dict[str, Request],
        events: list[tuple[str, Request]],
        times: tuple[float, float, float, float],
    ) -> None:
        """Logs the lifecycle events of a step's schedule, then the step line.

        Args:
            scheduler_output: What the step ran.
            requests: The scheduler's unfinished requests, as they were right after ``schedule()``.
            events: ``(kind, request)`` transitions the schedule made.
            times: perf_counter at the step's start, after scheduling, after forward and
                sampling, and at its end.
        """
        self.num_steps += 1
        for kind, request in events:
            if kind == "scheduled":
                logger.debug(
                    "request %s scheduled: cached=%d of %d prompt tokens",
                    request.req_id, request.num_cached_tokens, request.num_prompt_tokens,
                )  # fmt: skip
            else:
                logger.debug("request %s %s: output=%d", request.req_id, kind, request.num_output_tokens)
        num_prefill = sum(
            s.req_id in requests and s.num_computed_tokens < requests[s.req_id].num_prompt_tokens
            for s in scheduler_output.scheduled
        )
        pool = self.pool
        blocks = self._block_totals()
        allocated, freed, evicted = (now - before for now, before in zip(blocks, self._blocks))
        self._blocks = blocks
        start, scheduled, computed, end = times
        logger.debug(
            "step %d: prefill=%d decode=%d tokens=%d | blocks +%d -%d evicted=%d free=%d/%d | "
            "schedule %.2f ms, forward+sample %.2f ms, output %.2f ms",
            self.num_steps, num_prefill, len(scheduler_output.scheduled) - num_prefill,
            scheduler_output.total_num_scheduled_tokens, allocated, freed, evicted, pool.num_free_blocks,
            pool.num_blocks, (scheduled - start) * 1e3, (computed - scheduled) * 1e3, (end - computed) * 1e3,
        )  # fmt: skip

    @staticmethod
    def added(request: Request) -> None:
        params = request.sampling_params
        logger.debug(
            "request %s added: prompt=%d max_tokens=%s priority=%d tenant=%s",
            request.req_id, request.num_prompt_tokens, params.max_tokens, request.priority, request.tenant,
        )  # fmt: skip

    @staticmethod
    def finished(request_id: str, num_output_tokens: int, reason: str, metrics: RequestMetrics) -> None:
        logger.debug(
            "request %s finished: reason=%s output=%d e2e=%s queue=%s prefill=%s decode=%s preempted=%.3fs",
            request_id, reason, num_output_tokens,
            _seconds(metrics.e2e_latency), _seconds(metrics.time_in_queue), _seconds(metrics.prefill_time),
            _seconds(metrics.decode_time), metrics.preempted_seconds,
        )  # fmt: skip


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"
