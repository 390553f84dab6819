"""Counters and histograms behind ``stats()`` and ``/metrics``: Prometheus-style cumulative buckets."""

from __future__ import annotations

import bisect
import math
from typing import Any, Sequence

from engine.outputs import RequestMetrics

# Seconds; spans a fast GPU decode step (ms) to a long CPU queue wait (minutes).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)


class Histogram:
    """Counts of observations per bucket (upper bounds, ``le``), plus their count and sum.

    ``quantile`` interpolates linearly inside the bucket, as Prometheus'
    ``histogram_quantile`` does.
    """

    __slots__ = ("bounds", "counts", "count", "sum")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError("histogram bounds must be strictly increasing and non-empty")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last = +Inf bucket
        self.count = 0
        self.sum = 0.0

    @classmethod
    def merged(cls, snapshots: Sequence[dict[str, Any]]) -> Histogram:
        """One histogram holding the observations of ``snapshot()``s taken of histograms with the same bounds.

        Raises:
            ValueError: no snapshot, or their bounds differ.
        """
        if not snapshots:
            raise ValueError("nothing to merge")
        bounds = [le for le, _ in snapshots[0]["buckets"][:-1]]
        merged = cls(bounds)
        for snapshot in snapshots:
            if [le for le, _ in snapshot["buckets"][:-1]] != bounds:
                raise ValueError("histograms with different bounds cannot be merged")
            below = 0
            for i, (_, cumulative) in enumerate(snapshot["buckets"]):
                merged.counts[i] += cumulative - below
                below = cumulative
            merged.count += snapshot["count"]
            merged.sum += snapshot["sum"]
        return merged

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def quantile(self, q: float) -> float:
        """The ``q``-quantile (0..1) estimated from the buckets; NaN when empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1]; got {q}")
        if self.count == 0:
            return math.nan
        rank = q * self.count
        cumulative = 0
        for i, n in enumerate(self.counts):
            if n and cumulative + n >= rank:
                if i == len(self.bounds):  # +Inf bucket: the largest finite bound is all we know
                    return self.bounds[-1]
                low = self.bounds[i - 1] if i > 0 else 0.0
                return low + (self.bounds[i] - low) * (rank - cumulative) / n
            cumulative += n
        return self.bounds[-1]

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready copy: cumulative ``buckets`` as ``[le, count]`` (last ``le`` is inf), quantiles."""
        cumulative, buckets = 0, []
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            cumulative += n
            buckets.append([bound, cumulative])
        return {
            "count": self.count,
            "sum": self.sum,
            "mean": self.mean,
            "p50": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "p99": self.quantile(0.99),
            "buckets": buckets,
        }


class RequestStats:
    """What became of the user requests the engine took: counts by outcome and latency by phase.

    NOTE: every request taken is counted once in ``num_received`` and, when it ends, once in
    ``num_success[reason]`` or ``num_aborted`` (failed requests end as aborted), so
    received = sum(success) + aborted + the requests still unfinished. Requests refused
    before they entered (``num_rejected``) are in none of these.
    """

    def __init__(self) -> None:
        self.num_received = 0
        self.num_rejected = 0
        self.num_aborted = 0
        self.num_success: dict[str, int] = {}  # finish reason ("stop", "length") -> requests
        self.e2e = Histogram()
        self.queue_time = Histogram()
        self.prefill_time = Histogram()
        self.decode_time = Histogram()

    def finished(self, reason: str, metrics: RequestMetrics) -> None:
        """Counts one ended request and observes the phases it went through."""
        if reason == "abort":
            self.num_aborted += 1
        else:
            self.num_success[reason] = self.num_success.get(reason, 0) + 1
        for histogram, value in (
            (self.e2e, metrics.e2e_latency),
            (self.queue_time, metrics.time_in_queue),
            (self.prefill_time, metrics.prefill_time),
            (self.decode_time, metrics.decode_time),
        ):
            if value is not None:
                histogram.observe(value)

    def snapshot(self) -> dict[str, Any]:
        """The ``stats()`` entries, under their agreed keys."""
        return {
            "requests_received": self.num_received,
            "requests_rejected": self.num_rejected,
            "requests_aborted": self.num_aborted,
            "request_success": dict(self.num_success),
            "e2e_request_latency_seconds": self.e2e.snapshot(),
            "request_queue_time_seconds": self.queue_time.snapshot(),
            "request_prefill_time_seconds": self.prefill_time.snapshot(),
            "request_decode_time_seconds": self.decode_time.snapshot(),
        }


class SpecDecodeStats:
    """Speculative decoding's counts, under vLLM's names: drafts verified, drafts accepted, and accepted by position.

    NOTE: ``num_accepted_tokens_per_pos[i]`` counts the steps that accepted draft ``i`` (0-based), so it
    never grows along ``i`` and sums to ``num_accepted_tokens`` <= ``num_draft_tokens``.

    Args:
        num_positions: Most drafts per request and step (``num_speculative_tokens``; 0 = off).
    """

    def __init__(self, num_positions: int) -> None:
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * num_positions

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """Counts one request's step: ``num_accepted`` of its ``num_drafts`` drafts were accepted."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def snapshot(self) -> dict[str, Any]:
        """The ``stats()`` entries, under their agreed keys."""
        return {
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }
