"""Cancellation from every side: abort by id, of sharers, of waiting and preempted requests, task cancellation and timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from engine import AsyncEngine, Engine, SamplingParams
from engine.request import RequestStatus
from tests.support.quiescence import check_engine_quiescent
from sdk import AsyncClient
from sdk.hooks import AuditLog
from sdk.errors import RequestTimeout
from sdk.runtime import Runtime
from sdk.transport import InProcessTransport
from tests.reliability.conftest import ENGINE_CONFIG
from tests.support.step_gate import StepGate, hold_after_first_token

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
SHARED = list(range(900, 916))  # four full blocks of 4


async def cancel_while_streaming(stream: AsyncIterator[object], gate: StepGate) -> None:
    """Consume ``stream`` in a task and cancel that task once the driver holds (its request has a token)."""

    async def consume() -> None:
        async for _ in stream:
            pass

    task = asyncio.ensure_future(consume())
    await gate.wait_held()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.fixture
async def engine(model_dir):
    async with AsyncEngine(str(model_dir), **ENGINE_CONFIG) as e:
        yield e


async def _tokens(stream) -> list[int]:
    last = None
    async for last in stream:
        pass
    return last.outputs[0].token_ids


async def test_abort_twice_or_of_an_unknown_id_is_a_no_op(engine, quiescent) -> None:
    """abort() of an unknown id does nothing; aborting one request twice ends it once, with "abort"."""
    await engine.abort("never-seen")
    async with hold_after_first_token(engine):  # NOTE: the aborts are queued before it can finish
        stream = engine.generate(list(range(10, 20)), LONG, request_id="a")
        first = await anext(stream)
        await engine.abort("a")
        await engine.abort("a")
    outs = [first] + [o async for o in stream]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert sum(o.finished for o in outs) == 1
    await engine.abort("a")
    assert await _tokens(engine.generate(list(range(10, 20)), GREEDY, request_id="a"))  # the id is free again
    await quiescent(engine)


async def test_aborting_a_prefix_sharer_leaves_the_other_output_unchanged(engine, model_dir, quiescent) -> None:
    """B shares A's cached prompt blocks; aborting A mid-generation changes none of B's tokens."""
    alone = Engine(str(model_dir), **ENGINE_CONFIG).generate([SHARED + [5, 6]], GREEDY, use_tqdm=False)[0]
    a = engine.generate(SHARED + [1, 2, 3], LONG, request_id="A")
    await anext(a)  # A's prompt blocks are cached and held
    b_outs = []
    async for out in engine.generate(SHARED + [5, 6], GREEDY, request_id="B"):
        b_outs.append(out)
        if len(b_outs) == 3:
            await engine.abort("A")
    a_outs = [o async for o in a]
    assert a_outs[-1].outputs[0].finish_reason == "abort"
    assert b_outs[-1].num_cached_tokens == 16  # B really shared A's blocks
    assert b_outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    await quiescent(engine)


def test_aborting_waiting_and_preempted_requests_removes_them_for_good(model_dir) -> None:
    """A waiting request and a preempted one, once aborted, never run again; the others finish in full."""
    engine = Engine(str(model_dir), **dict(ENGINE_CONFIG, num_blocks=12, max_num_seqs=2))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(40 + 10 * i, 46 + 10 * i)), params)
    engine.step()
    assert engine.scheduler.requests["r2"].status == RequestStatus.WAITING
    (waiting,) = engine.abort_request("r2")
    assert waiting.finished and waiting.outputs[0].finish_reason == "abort" and waiting.outputs[0].token_ids == []
    while engine.scheduler.num_preemptions == 0:
        engine.step()
    preempted = [r for r in engine.scheduler.requests.values() if r.status == RequestStatus.PREEMPTED]
    assert len(preempted) == 1
    victim = preempted[0].req_id
    num_tokens = len(preempted[0].output_token_ids)
    (out,) = engine.abort_request(victim)
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == num_tokens
    seen = set()
    while engine.has_unfinished_requests():
        seen.update(o.request_id for o in engine.step())
    assert seen == {"r0", "r1"} - {victim}
    assert engine.abort_request(["r2", victim]) == []
    check_engine_quiescent(engine)


async def test_task_cancellation_and_timeouts_through_the_sdk_abort(engine, tmp_path, quiescent) -> None:
    """A cancelled task, a wait_for timeout and the SDK's own timeout each abort the engine request, audited once."""
    audit = tmp_path / "audit.jsonl"
    client = AsyncClient(transport=InProcessTransport(engine), hooks=[AuditLog(audit)])
    options = dict(max_tokens=100, ignore_eos=True)

    # NOTE: each request is held after its first token until it is cancelled: none can finish first.
    async with hold_after_first_token(engine) as gate:
        task = asyncio.ensure_future(client.complete([3, 4, 5, 6], request_id="cancelled", **options))
        await gate.wait_held()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    async with hold_after_first_token(engine):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.chat("Tell me a story", request_id="wait_for", **options), 0.1)
    async with hold_after_first_token(engine):
        with pytest.raises(RequestTimeout):
            await client.chat("Tell me a story", request_id="own-timeout", timeout=0.1, **options)
    async with hold_after_first_token(engine) as gate:
        await cancel_while_streaming(client.stream("Hello", request_id="stream", **options), gate)
    await quiescent(engine)
    records = {r["request_id"]: r for r in map(json.loads, audit.read_text().splitlines())}
    assert set(records) == {"cancelled", "wait_for", "own-timeout", "stream"}
    assert all(r["finish_reason"] == "abort" for r in records.values())
    assert records["own-timeout"]["error"] is not None and records["cancelled"]["error"] == "CancelledError"


@pytest.fixture
async def adapter_runtime(model_dir):
    """A runtime for (model_dir, ENGINE_CONFIG), its engine loaded, for an adapter to run on."""
    async with Runtime(str(model_dir), **ENGINE_CONFIG) as runtime:
        await runtime.start()
        yield runtime


async def test_langchain_cancellation_and_timeouts_abort(adapter_runtime, quiescent) -> None:
    """PagedChat.ainvoke / astream under wait_for or task.cancel abort the engine request."""
    from sdk.integrations.langchain import PagedChat

    adapter_engine = adapter_runtime.engine
    chat = PagedChat(runtime=adapter_runtime, max_tokens=100)
    async with hold_after_first_token(adapter_engine):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(chat.ainvoke("Tell me a story"), 0.1)
    async with hold_after_first_token(adapter_engine) as gate:
        await cancel_while_streaming(chat.astream("Tell me a story"), gate)
    await quiescent(adapter_engine)
    assert (await chat.ainvoke("Hi", max_tokens=2)).content is not None  # still serving
    await quiescent(adapter_engine)


async def test_llamaindex_cancellation_and_timeouts_abort(adapter_runtime, quiescent) -> None:
    """PagedLLM.achat / astream_chat / acomplete under wait_for or task.cancel abort the engine request."""
    from llama_index.core.llms import ChatMessage as LIChatMessage

    from sdk.integrations.llamaindex import PagedLLM

    adapter_engine = adapter_runtime.engine
    llm = PagedLLM(runtime=adapter_runtime, max_tokens=100)
    messages = [LIChatMessage(role="user", content="Tell me a story")]
    async with hold_after_first_token(adapter_engine):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(llm.achat(messages), 0.1)
    async with hold_after_first_token(adapter_engine):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(llm.acomplete("Once upon a time"), 0.1)
    async with hold_after_first_token(adapter_engine) as gate:
        await cancel_while_streaming(await llm.astream_chat(messages), gate)
    await quiescent(adapter_engine)
