"""Fault injection: a sampling fault fails one request, a forward fault fails one step, a dead loop wakes everyone."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from engine import AsyncEngine, Engine, EngineError, SamplingParams
from tests.support.faults import InjectedFault, inject_fault
from tests.support.quiescence import check_engine_quiescent
from integrations.openai_server.app import create_app
from integrations.openai_server.state import STATE
from integrations.openai_server.serving import Serving
from sdk import AsyncClient
from sdk.hooks import AuditLog
from sdk.errors import EngineFailure
from sdk.transport import InProcessTransport
from tests.integrations.conftest import LiveServer
from tests.reliability.conftest import ENGINE_CONFIG

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(500 + 41 * i, 500 + 41 * i + 6 + 5 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    """Greedy tokens of PROMPTS, each run alone with no fault."""
    engine = Engine(str(model_dir), **ENGINE_CONFIG)
    return [engine.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.fixture
async def engine(model_dir):
    async with AsyncEngine(str(model_dir), **ENGINE_CONFIG) as e:
        yield e


async def run(engine: AsyncEngine, prompt, params=GREEDY, **kw) -> list[int]:
    last = None
    async for last in engine.generate(prompt, params, **kw):
        pass
    return last.outputs[0].token_ids


def test_fault_switch_restores_the_engine(model_dir) -> None:
    """Leaving the block puts the real methods back; `after` and `times` choose which calls fail."""
    engine = Engine(str(model_dir), **ENGINE_CONFIG)
    real_sampler, real_schedule = engine.sampler, engine.scheduler.schedule
    with inject_fault(engine, "execute_model", after=1, times=1) as fault:
        out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False)  # one call: passes
        assert fault.num_calls == 1 and fault.num_fired == 0 and len(out[0].outputs[0].token_ids) == 1
        with pytest.raises(EngineError, match="injected fault in execute_model"):
            engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
        assert fault.num_fired == 1
    assert "execute_model" not in vars(engine.runner)
    assert engine.sampler is real_sampler and engine.scheduler.schedule == real_schedule
    check_engine_quiescent(engine)
    with pytest.raises(ValueError, match="site"):
        with inject_fault(engine, "detokenizer"):  # type: ignore[arg-type]
            pass


async def test_sampling_fault_fails_that_request_alone(engine, reference, quiescent) -> None:
    """The sampler raising for one request (n=2 siblings included) fails it; the others' tokens are unchanged."""
    with inject_fault(engine, "sampler", request_id="bad", times=None) as fault:
        tasks = [asyncio.ensure_future(run(engine, p, request_id=f"ok{i}")) for i, p in enumerate(PROMPTS[:3])]
        bad = asyncio.ensure_future(run(engine, PROMPTS[3], SamplingParams(n=2, max_tokens=8), request_id="bad"))
        results = await asyncio.gather(*tasks, bad, return_exceptions=True)
    assert fault.num_fired >= 1
    assert isinstance(results[3], EngineError) and "sampling failed" in str(results[3])
    assert results[:3] == reference[:3]
    await quiescent(engine)


async def test_forward_fault_fails_the_step_and_the_engine_serves_on(engine, reference, quiescent) -> None:
    """A forward fault fails every request of that step with EngineError, frees their blocks; the next one is served."""
    with inject_fault(engine, "execute_model", after=3) as fault:
        results = await asyncio.gather(*(run(engine, p) for p in PROMPTS[:3]), return_exceptions=True)
    assert fault.num_fired == 1
    assert all(isinstance(r, EngineError) and "injected fault" in str(r) for r in results)
    await quiescent(engine)
    assert await run(engine, PROMPTS[0]) == reference[0]
    assert engine.is_running
    await quiescent(engine)


async def test_forward_fault_through_sdk_is_engine_failure_and_audited(engine, tmp_path, quiescent) -> None:
    """Through the SDK a forward fault is EngineFailure, written once to the audit log with its error."""
    audit = tmp_path / "audit.jsonl"
    client = AsyncClient(transport=InProcessTransport(engine), hooks=[AuditLog(audit)])
    with inject_fault(engine, "execute_model", times=None):
        with pytest.raises(EngineFailure, match="injected fault"):
            await client.complete(PROMPTS[0], max_tokens=4, request_id="r-fail")
    result = await client.complete(PROMPTS[0], max_tokens=4, temperature=0.0, ignore_eos=True, request_id="r-ok")
    assert result.finish_reason == "length" and len(result.token_ids) == 4
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["request_id"], r["error"], r["finish_reason"]) for r in records] == [
        ("r-fail", "EngineFailure", None),
        ("r-ok", None, "length"),
    ]
    assert AuditLog.verify(audit) == 2
    await quiescent(client)


async def test_dead_engine_loop_turns_health_503_and_wakes_every_waiter(model_dir) -> None:
    """A fault that kills the driver: /health turns 503 and HTTP and SDK waiters all get an error within a second."""
    engine = AsyncEngine(str(model_dir), **ENGINE_CONFIG)
    app = create_app(serving_factory=lambda: Serving(engine))
    server = LiveServer(app).start()
    client = AsyncClient(transport=InProcessTransport(engine))
    body = {"prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        async with aiohttp.ClientSession() as http:

            async def http_stream() -> list[str]:
                async with http.post(f"{server.base_url}/completions", json=body) as resp:
                    assert resp.status == 200
                    return [line.decode().strip() async for line in resp.content if line.strip()]

            waiters = [asyncio.ensure_future(http_stream()) for _ in range(3)]
            waiters += [asyncio.ensure_future(client.complete(p, max_tokens=100, ignore_eos=True)) for p in PROMPTS[:2]]
            while engine.stats()["num_requests_running"] < 5:
                await asyncio.sleep(0.01)
            with inject_fault(engine, "schedule", error=InjectedFault("scheduler bug")):
                start = time.perf_counter()
                results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 1.0)
                woken = time.perf_counter() - start
            async with http.get(f"{server.root}/health") as resp:
                assert resp.status == 503 and (await resp.json())["status"] == "dead"
            async with http.post(f"{server.base_url}/completions", json=body) as resp:
                assert resp.status == 503
        assert woken < 1.0
        for lines in results[:3]:  # each stream ends with an error event and [DONE], never hangs
            assert '"engine_error"' in lines[-2] and lines[-1] == "data: [DONE]"
        for error in results[3:]:
            assert isinstance(error, EngineFailure) and "scheduler bug" in str(error)
        assert not engine.is_running and app[STATE].phase.value == "dead"
        with pytest.raises(EngineFailure, match="died"):
            await client.complete(PROMPTS[1], max_tokens=2)
    finally:
        server.stop()
        await engine.shutdown()
