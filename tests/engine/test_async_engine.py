"""AsyncEngine: streaming, cancellation, admission limits, pins, faults and a dead driver."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import AsyncEngine, Engine, EngineError, EngineOverloaded, RequestRejected, SamplingParams
from engine.supervisor import RestartPolicy
from tests.support.quiescence import assert_quiescent
from tests.support.step_gate import hold_after_first_token, hold_driver, wait_until

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(400 + 37 * i, 400 + 37 * i + 5 + 3 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    """Greedy tokens of PROMPTS from the synchronous engine."""
    engine = Engine(str(model_dir), num_blocks=64, block_size=4)
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture
async def engine(model_dir):
    async with AsyncEngine(str(model_dir), num_blocks=64, block_size=4, max_queued_requests=8) as e:
        yield e


async def collect(engine: AsyncEngine, prompt, params=GREEDY, **kw) -> list:
    return [out async for out in engine.generate(prompt, params, **kw)]


async def assert_pool_whole(engine: AsyncEngine) -> None:
    """Waits for aborts in flight to land, then every block is free and no request is left."""
    await assert_quiescent(engine, timeout=60.0)


async def test_stream_is_cumulative_and_matches_sync(engine: AsyncEngine, reference) -> None:
    """Each streamed output extends the previous one; the last is finished and equals Engine.generate."""
    outs = await collect(engine, PROMPTS[0])
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 10
    assert all(not o.finished for o in outs[:-1]) and outs[-1].finished
    assert outs[-1].outputs[0].token_ids == reference[0]
    assert outs[-1].outputs[0].text == engine.tokenizer.decode(reference[0], skip_special_tokens=True)


async def test_concurrent_requests_equal_sync(engine: AsyncEngine, reference) -> None:
    """Requests streamed concurrently give the same greedy tokens as the synchronous batch."""
    results = await asyncio.gather(*(collect(engine, p) for p in PROMPTS))
    assert [r[-1].outputs[0].token_ids for r in results] == reference
    await assert_pool_whole(engine)


async def test_closing_the_iterator_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    """Breaking out of a stream (aclose) aborts the request; every block comes back."""
    agen = engine.generate(PROMPTS[1], LONG)
    async for out in agen:
        if len(out.outputs[0].token_ids) >= 3:
            break
    await agen.aclose()
    await assert_pool_whole(engine)


async def test_task_cancellation_aborts(engine: AsyncEngine) -> None:
    """Cancelling the consuming task aborts the request and frees its blocks."""
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(PROMPTS[2], LONG):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_pool_whole(engine)


async def test_abort_by_id_ends_stream_with_abort(engine: AsyncEngine) -> None:
    """abort(request_id) ends the stream with finish_reason "abort"; unknown ids and repeats are no-ops."""
    outs = []
    async for out in engine.generate(PROMPTS[0], LONG, request_id="victim"):
        outs.append(out)
        if len(outs) == 2:
            await engine.abort("victim")
            await engine.abort("victim")
            await engine.abort("never-existed")
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    await assert_pool_whole(engine)


async def test_validation_errors_raise_before_queueing(engine: AsyncEngine) -> None:
    """Bad prompts raise RequestRejected from the first __anext__; nothing is queued."""
    for bad, match in [([], "empty"), ([10**9], "vocabulary"), (list(range(300)), "KV cache")]:
        with pytest.raises(RequestRejected, match=match):
            await engine.generate(bad, GREEDY).__anext__()
    assert engine.stats()["num_requests_waiting"] == 0


async def test_admission_limit_is_atomic(model_dir) -> None:
    """With max_queued_requests=2, a third queued request gets EngineOverloaded; slots free up after."""
    async with AsyncEngine(str(model_dir), num_blocks=64, block_size=4, max_queued_requests=2) as engine:
        async with hold_driver(engine):  # nothing leaves the queue meanwhile
            streams = [engine.generate(p, GREEDY) for p in PROMPTS[:3]]
            firsts = [asyncio.ensure_future(s.__anext__()) for s in streams[:2]]
            await asyncio.sleep(0)
            with pytest.raises(EngineOverloaded, match="max_queued_requests"):
                await streams[2].__anext__()
        await asyncio.gather(*firsts)
        for s in streams[:2]:
            async for _ in s:
                pass
        assert len(await collect(engine, PROMPTS[3])) == 10


async def test_pin_prefix_keeps_blocks_until_unpinned(engine: AsyncEngine) -> None:
    """A pinned prefix holds its blocks; a prompt extending it hits them; unpinning releases them."""
    system = list(range(1000, 1018))  # 4 full blocks of 4 + 2 tokens
    pin = await engine.pin_prefix(system)
    assert pin.num_tokens == 18 and pin.num_cached_tokens == 0
    used = await engine.call(lambda e: e.kv.stats().num_used_blocks)
    assert used == 5
    outs = await collect(engine, system + [7, 8, 9])
    assert outs[-1].num_cached_tokens == 16
    again = await engine.pin_prefix(system)
    assert again.num_cached_tokens == 16
    await engine.unpin_prefix(pin.pin_id)
    await engine.unpin_prefix(again.pin_id)
    await engine.unpin_prefix("unknown")
    await assert_pool_whole(engine)


async def test_failed_step_raises_engine_error_and_engine_goes_on(engine: AsyncEngine) -> None:
    """A fault in execute_model fails that step's requests with EngineError; later requests are served."""

    def break_once(e: Engine) -> None:
        real = e.runner.execute_model

        def fail(scheduler_output):
            e.runner.execute_model = real
            raise RuntimeError("device fault")

        e.runner.execute_model = fail

    await engine.call(break_once)
    with pytest.raises(EngineError, match="device fault"):
        await collect(engine, PROMPTS[0])
    await assert_pool_whole(engine)
    assert len((await collect(engine, PROMPTS[0]))[-1].outputs[0].token_ids) == 10
    assert engine.is_running


async def test_dead_driver_wakes_waiters(model_dir) -> None:
    """With restarts off, a driver loop that dies leaves the engine dead: every waiter gets EngineError within a
    second and new calls fail fast (restarts: tests/reliability/test_self_healing.py)."""
    engine = AsyncEngine(str(model_dir), restart=RestartPolicy(max_restarts=0), num_blocks=64, block_size=4)

    died = 0.0

    def explode(e: Engine) -> None:
        nonlocal died

        def boom():
            raise RuntimeError("scheduler bug")

        e.scheduler.schedule = boom
        died = time.perf_counter()

    # NOTE: the scheduler breaks once a request has a token (the next step dies): none can have finished.
    async with hold_after_first_token(engine, then=explode) as gate:
        streams = [asyncio.ensure_future(collect(engine, p, LONG)) for p in PROMPTS[:2]]
        await gate.wait_held()
    for s in streams:
        with pytest.raises(EngineError, match="died"):
            await s
    assert time.perf_counter() - died < 1.5  # NOTE: the waiters' liveness poll is 0.5 s
    assert not engine.is_running and engine.health().status == "dead"
    with pytest.raises(EngineError, match="not restarted: restarts are off"):
        await collect(engine, PROMPTS[0])
    await engine.shutdown()


async def test_shutdown_is_idempotent_and_final(model_dir) -> None:
    """shutdown() aborts running streams, can be called twice, and later calls raise EngineError."""
    engine = AsyncEngine(str(model_dir), num_blocks=64, block_size=4)
    async with hold_after_first_token(engine) as gate:
        stream = asyncio.ensure_future(collect(engine, PROMPTS[0], LONG))
        await gate.wait_held()
        closing = asyncio.ensure_future(engine.shutdown())
        await wait_until(lambda: engine.health().status == "stopped", "the shutdown to be posted")
    await closing
    await engine.shutdown()
    outs = await stream
    assert outs[-1].outputs[0].finish_reason == "abort"
    assert not engine.is_running
    with pytest.raises(EngineError):
        await collect(engine, PROMPTS[0])


async def test_properties_and_stats(engine: AsyncEngine) -> None:
    """tokenizer, model_name, max_model_len and stats() are readable from the caller's thread."""
    await collect(engine, PROMPTS[0])
    stats = engine.stats()
    assert stats["generation_tokens"] >= 10 and stats["num_requests_running"] == 0
    assert engine.max_model_len == 2048 and engine.model_name and engine.tokenizer.decode([400])
