"""Fault injection: a sampling fault fails one request, a forward fault fails one step (a dead driver: test_self_healing)."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine import AsyncEngine, Engine, EngineError, SamplingParams
from tests.support.faults import inject_fault
from tests.support.quiescence import check_engine_quiescent
from sdk import AsyncClient
from sdk.hooks import AuditLog
from sdk.errors import EngineFailure
from sdk.transport import InProcessTransport
from tests.reliability.conftest import ENGINE_CONFIG

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
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
