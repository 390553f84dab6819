"""Resume on restart: requests in flight when the driver dies go on, on the fresh engine, as if nothing happened.

Each test kills the driver with a fault in ``Scheduler.schedule`` (outside the per-step
isolation) and compares every stream, delta by delta joined, with an unkilled run of the same
requests: tokens, text and finish reason identical, no block left referenced.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from engine import AsyncEngine, Engine, RequestPoisoned, SamplingParams
from engine.core.scheduler import Scheduler
from engine.errors import EngineRestarting
from engine.structured_output import StructuredOutput
from engine.supervisor import RestartPolicy
from tests.reliability.conftest import ENGINE_CONFIG
from tests.support.faults import inject_fault
from tests.support.step_gate import wait_until

SPEC = {"mode": "always", "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CONFIG = dict(ENGINE_CONFIG, num_blocks=160, speculative_config=SPEC)
FAST = RestartPolicy(backoff_s=0.01, max_backoff_s=0.05)
PROMPTS = [list(range(200 + 31 * i, 200 + 31 * i + 6 + i % 5)) for i in range(8)]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 48, "temperature": 0.0, "ignore_eos": True, **kw})


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 48, "temperature": 0.9, "top_p": 0.9, "seed": seed, "ignore_eos": True, **kw})


@dataclass
class Streamed:
    """One stream's deltas, joined."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_logprobs: int = 0
    finish_reason: str | None = None
    num_prompt_deltas: int = 0  # deltas carrying the prompt: exactly one


async def stream(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str) -> Streamed:
    out = Streamed()
    async for delta in engine.stream(prompt, params, request_id=request_id):
        out.token_ids += delta.token_ids
        out.text += delta.text
        out.num_logprobs += len(delta.logprobs or [])
        out.num_prompt_deltas += delta.prompt_token_ids is not None
        out.finish_reason = delta.finish_reason or out.finish_reason
    return out


def stop_string(model_dir) -> str:
    """Three characters from the middle of PROMPTS[6]'s greedy text: a stop string the run reaches."""
    engine = Engine(str(model_dir), **CONFIG)
    text = engine.generate([PROMPTS[6]], greedy(), use_tqdm=False)[0].outputs[0].text
    return text[len(text) // 2 : len(text) // 2 + 3]


def requests(model_dir) -> list[SamplingParams]:
    """Eight streams: greedy, seeded sampling (with penalties, with logprobs), a JSON schema, a stop string."""
    return [
        greedy(),
        greedy(logprobs=2),
        seeded(7),
        seeded(8, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2),
        seeded(9, logprobs=1, top_k=20),
        greedy(structured_output=StructuredOutput(json_schema=SCHEMA), ignore_eos=False, max_tokens=60),
        greedy(stop=(stop_string(model_dir),)),
        greedy(min_tokens=4, max_tokens=40),
    ]


async def run_all(engine: AsyncEngine, params: list[SamplingParams]) -> list[Streamed]:
    return await asyncio.gather(*(stream(engine, p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params))))


@pytest.fixture(scope="module")
def reference(model_dir) -> tuple[list[SamplingParams], list[Streamed]]:
    """The eight requests, and their streams from an engine that never dies."""
    params = requests(model_dir)

    async def go() -> list[Streamed]:
        async with AsyncEngine(str(model_dir), **CONFIG) as engine:
            return await run_all(engine, params)

    return params, asyncio.run(go())


@pytest.mark.parametrize("seed", [0, 1])
async def test_streams_killed_three_times_finish_as_if_never_killed(model_dir, reference, quiescent, seed) -> None:
    """The driver killed at random steps three times in a row: every stream completes identical to an unkilled run
    (tokens, text, logprobs, finish reason; the prompt sent once), no block leaks, and stats count the resumes."""
    params, expected = reference
    assert expected[6].finish_reason == "stop" and len(expected[6].token_ids) < 48  # the stop string was reached
    rng = random.Random(seed)
    async with AsyncEngine(str(model_dir), restart=FAST, **CONFIG) as engine:
        runs = asyncio.ensure_future(run_all(engine, params))
        queued = lambda: engine.stats()["num_requests_running"] + engine.stats()["num_requests_waiting"]  # noqa: E731
        await wait_until(lambda: queued() == 8, "the engine to take all eight")  # NOTE: then none arrives mid-restart
        for death in range(1, 4):
            with inject_fault(engine, "schedule", after=rng.randint(1, 4)) as fault:
                await wait_until(lambda: engine.health().restarts == death or runs.done(), f"death {death}")
            assert fault.num_fired == 1, f"every stream finished before death {death}"
            await wait_until(lambda: engine.is_running, "the fresh engine")
        got = await runs
        for i, (want, have) in enumerate(zip(expected, got)):
            assert have == want, f"stream {i} differs from the unkilled run"
            assert have.num_prompt_deltas == 1
        stats = engine.stats()
        assert stats["engine_restarts"] == 3 and stats["requests_resumed"] >= 8
        assert stats["requests_poisoned"] == 0
        await quiescent(engine)


async def test_a_request_that_kills_every_engine_fails_alone_after_the_cap(model_dir, quiescent, monkeypatch) -> None:
    """A request whose run kills the driver each time: in flight at more deaths than max_resumes, it runs alone
    among the suspects and fails with RequestPoisoned naming it; the seven others finish, identical to a clean run."""
    params = [greedy(max_tokens=24)] * 8
    async with AsyncEngine(str(model_dir), **CONFIG) as clean:
        expected = await run_all(clean, params)
    real = Scheduler.schedule
    deaths = []

    def schedule(self: Scheduler):
        poison = self.requests.get("r3")
        # NOTE: the first death waits for all eight to be in the engine: none arrives mid-restart
        if poison is not None and poison.num_output_tokens >= 2 and (deaths or len(self.requests) == 8):
            deaths.append(sorted(self.requests))
            raise RuntimeError("poison")
        return real(self)

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    policy = RestartPolicy(backoff_s=0.01, max_backoff_s=0.05, max_resumes=1, max_restarts=5)
    async with AsyncEngine(str(model_dir), restart=policy, **CONFIG) as engine:
        results = await asyncio.gather(
            *(stream(engine, p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params))), return_exceptions=True
        )
        poisoned = results.pop(3)
        assert isinstance(poisoned, RequestPoisoned) and poisoned.request_id == "r3" and "'r3'" in str(poisoned)
        assert results == expected[:3] + expected[4:]
        assert engine.stats()["requests_poisoned"] == 1 and engine.health().restarts == 3
        assert len(deaths[0]) == len(deaths[1]) == 8 and deaths[2] == ["r3"]  # the last time it ran alone
        await quiescent(engine)


async def test_resume_off_fails_the_streams_in_flight_with_engine_restarting(model_dir, quiescent) -> None:
    """RestartPolicy(resume=False): a death ends each stream in flight with the retryable EngineRestarting."""
    policy = RestartPolicy(backoff_s=0.01, resume=False)
    async with AsyncEngine(str(model_dir), restart=policy, **CONFIG) as engine:
        with inject_fault(engine, "schedule", after=3):
            results = await asyncio.gather(
                *(stream(engine, p, greedy(), f"r{i}") for i, p in enumerate(PROMPTS[:4])), return_exceptions=True
            )
        assert all(isinstance(r, EngineRestarting) for r in results)
        await wait_until(lambda: engine.is_running, "the fresh engine")
        assert engine.stats()["requests_resumed"] == 0
        await quiescent(engine)


async def test_aborts_while_the_engine_restarts_end_the_kept_requests(model_dir, quiescent) -> None:
    """A stream closed, and a request aborted by id, while a fresh engine starts: once it serves, each kept
    request is aborted there (the one still read ends with "abort"), and every block comes back."""
    policy = RestartPolicy(backoff_s=2.0)  # NOTE: a restart window long enough to act in
    async with AsyncEngine(str(model_dir), restart=policy, **CONFIG) as engine:
        closed = asyncio.ensure_future(stream(engine, PROMPTS[0], greedy(max_tokens=100), "closed"))
        by_id = asyncio.ensure_future(stream(engine, PROMPTS[1], greedy(max_tokens=100), "by-id"))
        await wait_until(lambda: engine.stats()["num_requests_running"] == 2, "both requests to run")
        with inject_fault(engine, "schedule"):
            await wait_until(lambda: engine.health().status == "restarting", "the restart")
        closed.cancel()
        await engine.abort("by-id")
        with pytest.raises(asyncio.CancelledError):
            await closed
        assert (await by_id).finish_reason == "abort"
        await wait_until(lambda: engine.is_running, "the fresh engine")  # NOTE: the aborts land before it serves
        assert engine.stats()["requests_resumed"] == 2
        await quiescent(engine)
