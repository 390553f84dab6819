"""PoolingStats: per kind, the inputs, tokens and batches a pooling queue ran, each input's queue and compute
time, the batch sizes; merged over engines; and ``Engine.stats()["pooling"]`` on the shipped MiniLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.pooling import pooling_queue
from engine.pooling.params import PoolingParams
from engine.pooling.pooling_queue import PoolingQueue, PoolingRequest
from engine.pooling.pooling_stats import PoolingStats, merge_pooling


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class _Run:
    """A batch of one layer that takes one second of the fake clock."""

    num_stages = 1

    def __init__(self, clock: _Clock, kind: str, num_inputs: int) -> None:
        self.clock, self.kind, self.num_inputs, self.done = clock, kind, num_inputs, False

    def advance(self) -> None:
        self.clock.now += 1.0
        self.done = True

    def values(self):
        return [[0.0] if self.kind == "embed" else 0.5 for _ in range(self.num_inputs)]


class _Runner:
    """Runs a batch in one second of the fake clock."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def start(self, kind, inputs, params):
        return _Run(self.clock, kind, len(inputs))


def _request(i: int, kind: str, num_tokens: int) -> PoolingRequest:
    item = SimpleNamespace(token_ids=list(range(num_tokens)))
    return PoolingRequest(str(i), kind, item, PoolingParams(), lambda out: None, arrival_time=0.0)


def test_queue_and_compute_time_per_input_and_batch_sizes(monkeypatch) -> None:
    """Four one-token inputs arriving at 0 under a 2-token budget run as two 1-second batches: the second
    batch's inputs waited 1 s, every input's compute is its batch's second, and the sizes are 2 and 2."""
    clock = _Clock()
    monkeypatch.setattr(pooling_queue, "time", clock)
    queue = PoolingQueue(_Runner(clock), token_budget=2)
    for i in range(4):
        queue.add(_request(i, "embed", 1))
    queue.add(_request(4, "score", 3))
    while queue.has_unfinished():
        queue.step()
    embed, score = queue.stats.snapshot()["embed"], queue.stats.snapshot()["score"]
    assert (embed["inputs"], embed["tokens"], embed["batches"]) == (4, 4, 2)
    assert embed["queue_time_seconds"]["count"] == 4 and embed["queue_time_seconds"]["sum"] == 2.0
    assert embed["compute_time_seconds"]["count"] == 4 and embed["compute_time_seconds"]["sum"] == 4.0
    assert (embed["batch_size"]["count"], embed["batch_size"]["sum"]) == (2, 4.0)
    # the score pair ran third, alone: it waited two batches
    assert (score["inputs"], score["tokens"], score["batches"]) == (1, 3, 1)
    assert score["queue_time_seconds"]["sum"] == 2.0 and score["compute_time_seconds"]["sum"] == 1.0


def test_merge_adds_counts_and_histograms() -> None:
    """Two engines' snapshots merge into one: counts added, histogram buckets and sums added, quantiles of both."""
    a, b = PoolingStats(), PoolingStats()
    a.observe_batch("embed", [0.001, 0.002], 10, 0.01)
    b.observe_batch("embed", [5.0], 7, 0.2)
    b.observe_batch("score", [0.0], 3, 0.05)
    merged = merge_pooling(a.snapshot(), b.snapshot())
    assert (merged["embed"]["inputs"], merged["embed"]["tokens"], merged["embed"]["batches"]) == (3, 17, 2)
    queue = merged["embed"]["queue_time_seconds"]
    assert queue["count"] == 3 and queue["sum"] == pytest.approx(5.003) and queue["buckets"][-1][1] == 3
    assert queue["p99"] > 2.5  # the slow input is in the merged quantiles
    assert merged["embed"]["batch_size"]["sum"] == 3.0 and merged["score"]["inputs"] == 1


def test_engine_stats_report_the_batches(minilm_engine) -> None:
    """After an embed call, ``stats()["pooling"]["embed"]`` grew by its inputs and tokens, in batches whose sizes
    add up to the inputs; queue and compute times are observed once per input."""
    before = minilm_engine.stats()["pooling"]["embed"]
    texts = [f"chunk {i} about paged attention" for i in range(10)]
    outs = minilm_engine.embed(texts)
    after = minilm_engine.stats()["pooling"]["embed"]
    grew = {key: after[key] - before[key] for key in ("inputs", "tokens", "batches")}
    assert grew["inputs"] == 10 and grew["tokens"] == sum(len(o.prompt_token_ids) for o in outs) and grew["batches"] >= 1
    assert after["batch_size"]["sum"] - before["batch_size"]["sum"] == 10
    for key in ("queue_time_seconds", "compute_time_seconds"):
        assert after[key]["count"] - before[key]["count"] == 10
    assert after["compute_time_seconds"]["sum"] > before["compute_time_seconds"]["sum"]
