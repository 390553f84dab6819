"""A pooling queue beside a chat model: while the chat model has requests, each turn between two chat steps runs
the pooling batch's layers for at most the chat step's ``pooling_time_fraction`` (one layer at least); with none,
whole batches of the full budget. Fake costs on a fake clock, then the shipped MiniLM."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.chat_pace import ChatPace
from engine.pooling import pooling_queue
from engine.pooling.params import PoolingParams
from engine.pooling.pooling_queue import SHARED_POOLING_BUDGET, PoolingQueue, PoolingRequest

NUM_LAYERS = 6
SECONDS_PER_TOKEN_LAYER = 1e-4  # the fake cost model: a layer of a 200-token batch takes 20 ms
FULL_BUDGET = 2048


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class _Run:
    """A batch of ``NUM_LAYERS`` layers, each ``SECONDS_PER_TOKEN_LAYER`` per token of the fake clock."""

    def __init__(self, runner: _Runner, kind: str, num_tokens: int, num_inputs: int) -> None:
        self.runner, self.kind, self.num_tokens, self.num_inputs = runner, kind, num_tokens, num_inputs
        self.num_stages, self._next = NUM_LAYERS, 0

    @property
    def done(self) -> bool:
        return self._next >= self.num_stages

    def advance(self) -> None:
        self.runner.clock.now += SECONDS_PER_TOKEN_LAYER * self.num_tokens
        self.runner.layer_tokens.append(self.num_tokens)
        self._next += 1

    def values(self):
        return [[float(self.num_tokens)] for _ in range(self.num_inputs)]


class _Runner:
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.layer_tokens: list[int] = []  # tokens of each layer run, in order
        self.batch_tokens: list[int] = []

    def start(self, kind, inputs, params):
        num_tokens = sum(len(i.token_ids) for i in inputs)
        self.batch_tokens.append(num_tokens)
        return _Run(self, kind, num_tokens, len(inputs))


def _queue(monkeypatch, pace: ChatPace | None) -> tuple[PoolingQueue, _Runner, _Clock, list]:
    clock = _Clock()
    monkeypatch.setattr(pooling_queue, "time", clock)
    runner = _Runner(clock)
    queue = PoolingQueue(runner, FULL_BUDGET)
    if pace is not None:
        queue.share_steps(pace)
    answered: list = []
    return queue, runner, clock, answered


def _add(queue: PoolingQueue, answered: list, count: int, num_tokens: int = 200) -> None:
    for _ in range(count):
        item = SimpleNamespace(token_ids=list(range(num_tokens)))
        queue.add(PoolingRequest(queue.next_id(), "embed", item, PoolingParams(), answered.append))


def test_chat_pace_bounds_a_turn_by_the_active_chat_steps() -> None:
    """No active chat engine: no bound; active but unmeasured: 0 (one layer); measured: fraction times the median
    of its latest steps, the smallest over the active engines; an idle engine stops bounding and forgets its steps."""
    pace = ChatPace()
    assert pace.turn_seconds() is None
    pace.set_active(1, True, 0.25)
    assert pace.turn_seconds() == 0.0
    for seconds in (0.1, 0.1, 0.9):  # one slow step (a prefill) does not move the median
        pace.observe(1, seconds)
    assert pace.turn_seconds() == pytest.approx(0.025)
    pace.set_active(2, True, 0.5)
    pace.observe(2, 0.02)
    assert pace.turn_seconds() == pytest.approx(0.01)
    pace.set_active(2, False, 0.5)
    pace.set_active(1, False, 0.25)
    assert pace.turn_seconds() is None
    pace.set_active(1, True, 0.25)
    assert pace.turn_seconds() == 0.0  # measured afresh
    pace.forget(1)
    assert pace.turn_seconds() is None


def test_turns_beside_decoding_chat_stay_within_the_fraction(monkeypatch) -> None:
    """A chat engine whose steps take 100 ms with a fraction of 0.25: every pooling turn runs at most 25 ms of
    layers (so at most one 20 ms layer of a 200-token input, the cost model's), no batch over the shared budget
    nor over what one layer of fits the turn; the burst still finishes (one layer a turn at least), every
    request answered once."""
    pace = ChatPace()
    pace.set_active(1, True, 0.25)
    for _ in range(3):
        pace.observe(1, 0.100)
    queue, runner, clock, answered = _queue(monkeypatch, pace)
    _add(queue, answered, 30)
    turns = 0
    while queue.has_unfinished():
        before = clock.now
        queue.step()  # one pooling turn; the chat step that follows is the next loop's
        turns += 1
        assert clock.now - before <= 0.025 + 1e-12
    assert len(answered) == 30 and len({o.request_id for o in answered}) == 30
    assert max(runner.batch_tokens) <= SHARED_POOLING_BUDGET
    assert turns == 30 * NUM_LAYERS  # one layer of one 200-token input a turn: 20 ms of the 25 allowed


def test_a_turn_below_one_layer_still_runs_one(monkeypatch) -> None:
    """A turn bound smaller than any layer (a fast chat step, 10 ms at 0.25): each turn runs exactly one layer
    of a one-input batch, so embeddings progress a layer per chat step and every one is answered."""
    pace = ChatPace()
    pace.set_active(1, True, 0.25)
    pace.observe(1, 0.010)
    queue, runner, clock, answered = _queue(monkeypatch, pace)
    _add(queue, answered, 5)
    layers_before = 0
    while queue.has_unfinished():
        queue.step()
        assert len(runner.layer_tokens) == layers_before + 1
        layers_before += 1
    assert len(answered) == 5 and runner.batch_tokens == [200] * 5


def test_alone_a_step_runs_a_whole_batch_of_the_full_budget(monkeypatch) -> None:
    """With no chat request (or not sharing steps at all), a step runs a whole batch of the full token budget:
    embedding throughput alone is what it was, 10 inputs of 200 tokens a batch."""
    for pace in (None, ChatPace()):
        queue, runner, _, answered = _queue(monkeypatch, pace)
        _add(queue, answered, 25)
        assert [queue.step() for _ in range(3)] == [10, 10, 5]
        assert runner.batch_tokens == [2000, 2000, 1000] and not queue.has_unfinished()


def test_a_batch_yields_after_its_layer_once_chat_requests_arrive(monkeypatch) -> None:
    """A full-budget batch started while the chat model was idle stops after the layer in which a chat request
    arrived, finishes a layer a turn beside the decodes, and the next batch is cut to the shared budget; once the
    chat model is idle again the batches are full."""
    pace = ChatPace()
    queue, runner, clock, answered = _queue(monkeypatch, pace)
    _add(queue, answered, 40)

    original = runner.start

    def start(kind, inputs, params):
        run = original(kind, inputs, params)
        advance = run.advance

        def advance_and_chat():
            advance()
            if len(runner.layer_tokens) == 2:  # a chat request arrives during the second layer
                pace.set_active(1, True, 0.25)
                pace.observe(1, 0.010)

        run.advance = advance_and_chat
        return run

    runner.start = start
    assert queue.step() == 0 and runner.layer_tokens == [2000, 2000]  # yielded mid-batch
    while len(answered) < 10:
        layers = len(runner.layer_tokens)
        queue.step()
        assert len(runner.layer_tokens) == layers + 1
    queue.step()
    assert runner.batch_tokens[-1] <= SHARED_POOLING_BUDGET
    pace.set_active(1, False, 0.25)
    while queue.has_unfinished():
        queue.step()
    assert len(answered) == 40 and max(runner.batch_tokens[2:]) == 2000


def test_layer_by_layer_embeddings_equal_whole_batches(minilm_dir) -> None:
    """The shipped MiniLM run a layer a turn (a chat engine active, no step measured: the tightest bound, so one
    input a batch once a layer was measured) gives exactly the embeddings of each input run whole, and
    ``stats()`` counts each input once."""
    from engine import Engine

    texts = [f"passage {i} on paged attention, prefix caching and retrieval " * (1 + i % 3) for i in range(7)]
    whole = Engine(model=str(minilm_dir), dtype="float32", device="cpu")
    expected = [whole.embed(text)[0].outputs.embedding for text in texts]
    staged = Engine(model=str(minilm_dir), dtype="float32", device="cpu")
    pace = ChatPace()
    pace.set_active(1, True, 0.25)
    staged.pooling.share_steps(pace)
    staged.embed(texts[0])  # measures a layer: from now on a batch holds what one layer of fits the turn, one input
    got = [o.outputs.embedding for o in staged.embed(texts)]
    np.testing.assert_array_equal(np.array(got), np.array(expected))
    embed = staged.stats()["pooling"]["embed"]
    assert embed["inputs"] == 8 and embed["batches"] == 8
