"""Overload: admission limits never over-admit, impossible requests are refused up front, KV pressure changes no output."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import AsyncEngine, EngineOverloaded, RequestRejected, SamplingParams
from tests.reliability.conftest import ENGINE_CONFIG
from tests.support.step_gate import hold_driver, wait_until

SHORT = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


async def _first(engine: AsyncEngine, prompt: list[int], request_id: str) -> bool:
    """Submits; True when admitted (the stream is then drained), False when refused as overloaded."""
    stream = engine.generate(prompt, SHORT, request_id=request_id)
    try:
        await anext(stream)
    except EngineOverloaded:
        return False
    async for _ in stream:
        pass
    return True


def _submit_from_thread(engine: AsyncEngine, tag: str, count: int, results: list[bool]) -> None:
    async def go() -> list[bool]:
        return await asyncio.gather(*(_first(engine, [7, 8, 9, 10], f"{tag}-{i}") for i in range(count)))

    results.extend(asyncio.run(go()))


@pytest.mark.parametrize("limit", ["requests", "tokens"])
async def test_a_thousand_simultaneous_submits_never_over_admit(model_dir, quiescent, limit) -> None:
    """1,000 submits from one loop and four threads while the driver is busy: exactly the limit is admitted."""
    config = dict(ENGINE_CONFIG, max_queued_requests=50) if limit == "requests" else dict(ENGINE_CONFIG, max_queued_tokens=200)
    async with AsyncEngine(str(model_dir), **config) as engine:
        thread_results: list[bool] = []
        threads = [
            threading.Thread(target=_submit_from_thread, args=(engine, f"t{k}", 100, thread_results)) for k in range(4)
        ]
        async with hold_driver(engine):  # nothing leaves the queue until every submit has been answered or queued
            for t in threads:
                t.start()
            local = asyncio.gather(*(_first(engine, [1, 2, 3, 4], f"l-{i}") for i in range(600)))
            await wait_until(lambda: engine.stats()["requests_rejected"] >= 950, "950 submits to be refused")
        results = await local
        for t in threads:
            await asyncio.to_thread(t.join)
        results += thread_results
        assert len(results) == 1000
        assert sum(results) == 50  # 50 requests, or 200 queued tokens / 4 per prompt
        assert engine.stats()["num_requests_waiting"] == 0
        await quiescent(engine)


async def test_a_request_that_can_never_fit_is_rejected_up_front(model_dir, quiescent) -> None:
    """A prompt longer than the whole KV cache is refused at submit, in milliseconds, and nothing is queued."""
    config = dict(ENGINE_CONFIG, num_blocks=8, max_model_len=1024)  # 32 tokens of cache
    async with AsyncEngine(str(model_dir), **config) as engine:
        start = time.perf_counter()
        with pytest.raises(RequestRejected, match="KV cache holds at most 32 tokens"):
            await anext(engine.generate(list(range(100, 140)), SHORT))
        assert time.perf_counter() - start < 0.1
        await quiescent(engine)


async def test_a_request_blocked_by_pinned_prefixes_finishes_instead_of_waiting(model_dir, quiescent) -> None:
    """When pins hold the blocks a request needs and nothing runs to free them, it ends ("length") within a second."""
    config = dict(ENGINE_CONFIG, num_blocks=8, max_model_len=1024)
    async with AsyncEngine(str(model_dir), **config) as engine:
        pin = await engine.pin_prefix(list(range(200, 224)))  # 6 of 8 blocks held
        start = time.perf_counter()
        outs = [o async for o in engine.generate(list(range(300, 320)), SHORT)]  # needs 6 blocks
        assert time.perf_counter() - start < 1.0
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        await engine.unpin_prefix(pin.pin_id)
        await quiescent(engine)


async def test_kv_exhaustion_preempts_and_everyone_gets_the_unpressured_output(model_dir, quiescent) -> None:
    """Eight long greedy and seeded generations on a cache too small for them all: preempted, then identical outputs."""
    prompts = [list(range(600 + 31 * i, 600 + 31 * i + 5 + 2 * i)) for i in range(8)]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True) for i in range(8)
    ]

    async def run_all(engine: AsyncEngine) -> list[list[int]]:
        async def one(i: int) -> list[int]:
            last = None
            async for last in engine.generate(prompts[i], params[i], request_id=f"r{i}"):
                pass
            return last.outputs[0].token_ids

        return await asyncio.gather(*(one(i) for i in range(8)))

    async with AsyncEngine(str(model_dir), **dict(ENGINE_CONFIG, num_blocks=256)) as roomy:
        expected = await run_all(roomy)
    async with AsyncEngine(str(model_dir), **dict(ENGINE_CONFIG, num_blocks=28)) as tight:  # 112 tokens for ~400
        got = await run_all(tight)
        assert tight.stats()["num_preemptions"] > 0
        await quiescent(tight)
    assert got == expected and all(len(t) == 40 for t in got)
