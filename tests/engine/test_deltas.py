"""Deltas: each carries only what its step added; joined, a request's deltas are its cumulative output."""

from __future__ import annotations

from collections import defaultdict

import pytest

from engine import AsyncEngine, Engine, SamplingParams
from engine.outputs import Delta, OutputAccumulator

PROMPTS = [list(range(300, 320)), list(range(400, 407)), list(range(300, 320)) + [9, 9]]


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> Engine:
    """A tiny llama whose steps hold a few requests at once (prefills in chunks of 32 tokens)."""
    return Engine(str(tiny_model_factory("llama")), num_blocks=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def params(engine: Engine) -> list[SamplingParams]:
    """Greedy; n=2 sampled with logprobs; greedy cut by a stop string found in its own greedy text."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    text = engine.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 :][:2]
    assert stop.strip()
    return [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(n=2, max_tokens=9, temperature=1.0, seed=5, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=stop),
    ]


def _by_request(deltas: list[Delta]) -> dict[str, list[Delta]]:
    grouped: dict[str, list[Delta]] = defaultdict(list)
    for delta in deltas:
        grouped[delta.request_id].append(delta)
    return grouped


def _joined(deltas: list[Delta], params: SamplingParams):
    accumulator = OutputAccumulator(params.n, params.logprobs is not None)
    for delta in deltas:
        accumulator.add(delta)
    return accumulator.output()


def _assert_one_request(deltas: list[Delta], prompt: list[int], n: int) -> None:
    """Prompt ids on the first delta only, usage on the last only and adding up, one finish per completion, last."""
    assert deltas[0].prompt_token_ids == prompt and all(d.prompt_token_ids is None for d in deltas[1:])
    assert deltas[-1].usage is not None and all(d.usage is None for d in deltas[:-1])
    usage = deltas[-1].usage
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == sum(len(d.token_ids) for d in deltas)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and usage.latency is not None
    for index in range(n):
        mine = [d for d in deltas if d.index == index]
        assert mine[-1].finish_reason is not None and all(d.finish_reason is None for d in mine[:-1])
        assert all(len(d.logprobs) == len(d.token_ids) for d in mine if d.logprobs is not None)


def test_deltas_add_up_to_the_cumulative_output(engine: Engine, params: list[SamplingParams]) -> None:
    """Batched step_deltas() of greedy, n=2 with logprobs and stop-string requests join into generate()'s outputs."""
    expected = engine.generate(PROMPTS, params, use_tqdm=False)
    for i, (prompt, sp) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"d{i}", prompt, sp)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step_deltas()
    grouped = _by_request(deltas)
    assert list(grouped) == ["d0", "d1", "d2"]
    assert expected[2].outputs[0].finish_reason == "stop"
    for i, (prompt, sp, reference) in enumerate(zip(PROMPTS, params, expected)):
        _assert_one_request(grouped[f"d{i}"], prompt, sp.n)
        joined = _joined(grouped[f"d{i}"], sp)
        assert joined.finished and joined.prompt_token_ids == reference.prompt_token_ids
        for got, want in zip(joined.outputs, reference.outputs, strict=True):
            assert (got.index, got.text, got.token_ids, got.finish_reason) == (want.index, want.text, want.token_ids, want.finish_reason)
            assert got.logprobs == want.logprobs
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_an_aborted_request_ends_with_its_last_delta(engine: Engine) -> None:
    """abort_request's final output is what the deltas so far plus its last one (reason "abort", usage) join into."""
    sp = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("long", PROMPTS[1], sp)
    deltas = engine.step_deltas() + engine.step_deltas() + engine.step_deltas()
    [final] = engine.abort_request("long")
    [last] = engine.pop_deltas()
    assert last.finish_reason == "abort" and last.usage is not None and engine.pop_deltas() == []
    joined = _joined([*deltas, last], sp)
    assert joined.outputs[0].token_ids == final.outputs[0].token_ids and joined.outputs[0].text == final.outputs[0].text
    assert last.usage.completion_tokens == len(final.outputs[0].token_ids)
    assert engine.step_deltas() == []


async def test_stream_joins_into_generate(engine: Engine, params: list[SamplingParams]) -> None:
    """AsyncEngine.stream's deltas of an n=2 request with logprobs join into AsyncEngine.generate's last output."""
    async with AsyncEngine(str(engine.model_dir), num_blocks=64, block_size=4) as async_engine:
        deltas = [d async for d in async_engine.stream(PROMPTS[0], params[1], cache_salt="stream")]
        outputs = [o async for o in async_engine.generate(PROMPTS[0], params[1], cache_salt="generate")]
    _assert_one_request(deltas, PROMPTS[0], 2)
    assert all(not o.finished for o in outputs[:-1]) and outputs[-1].finished
    joined, last = _joined(deltas, params[1]), outputs[-1]
    assert [(c.text, c.token_ids, c.finish_reason, c.logprobs) for c in joined.outputs] == [
        (c.text, c.token_ids, c.finish_reason, c.logprobs) for c in last.outputs
    ]
