"""PoolingStats: what a pooling engine's batches did, per kind (``embed``; ``score``, which rerank is too).

Per kind: inputs run (embeddings, scored pairs), their tokens, the batches, how long each input waited
from its arrival to its batch's start (queue), how long its batch ran (compute), and the batch sizes
(inputs per batch). ``Engine.stats()["pooling"]`` is its snapshot; ``/metrics`` exports it as
``paged_pooling_*{kind}``; ``merge_pooling`` adds up the snapshots of several engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.metrics import Histogram

POOLING_KINDS = ("embed", "score")
# inputs per batch: powers of two up to what the largest (CUDA) token budget packs of one-token inputs
BATCH_SIZE_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(14))


@dataclass(slots=True)
class KindStats:
    """One kind's figures."""

    num_inputs: int = 0
    num_tokens: int = 0
    num_batches: int = 0
    queue_time: Histogram = field(default_factory=Histogram)  # seconds, per input
    compute_time: Histogram = field(default_factory=Histogram)  # seconds of its batch's run, per input
    batch_size: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BUCKETS))  # inputs, per batch

    def snapshot(self) -> dict[str, Any]:
        return {
            "inputs": self.num_inputs,
            "tokens": self.num_tokens,
            "batches": self.num_batches,
            "queue_time_seconds": self.queue_time.snapshot(),
            "compute_time_seconds": self.compute_time.snapshot(),
            "batch_size": self.batch_size.snapshot(),
        }


class PoolingStats:
    """The figures of a pooling queue's batches, by kind; written by the driver thread only."""

    def __init__(self) -> None:
        self.kinds = {kind: KindStats() for kind in POOLING_KINDS}

    def observe_batch(self, kind: str, waited: Sequence[float], num_tokens: int, compute_s: float) -> None:
        """One batch of ``kind`` ran for ``compute_s`` seconds; its inputs had waited ``waited`` seconds each."""
        stats = self.kinds[kind]
        stats.num_inputs += len(waited)
        stats.num_tokens += num_tokens
        stats.num_batches += 1
        stats.batch_size.observe(len(waited))
        for seconds in waited:
            stats.queue_time.observe(max(seconds, 0.0))
            stats.compute_time.observe(compute_s)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """``{kind: {"inputs", "tokens", "batches", "queue_time_seconds", "compute_time_seconds", "batch_size"}}``
        (histograms as ``Histogram.snapshot()``); every kind present, zero before its first batch."""
        return {kind: stats.snapshot() for kind, stats in self.kinds.items()}


def merge_pooling(*snapshots: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The figures of several engines' ``PoolingStats`` snapshots together: counts added, histograms merged."""
    merged: dict[str, dict[str, Any]] = {}
    for kind in POOLING_KINDS:
        parts = [s[kind] for s in snapshots if kind in s]
        if not parts:
            continue
        merged[kind] = {key: sum(p[key] for p in parts) for key in ("inputs", "tokens", "batches")}
        for key in ("queue_time_seconds", "compute_time_seconds", "batch_size"):
            merged[kind][key] = Histogram.merged([p[key] for p in parts]).snapshot()
    return merged
