"""Tenants in process: policy caps, rate limits that never over-admit, cache isolation, fair share, hook origins."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from engine import AsyncEngine
from engine.errors import ParameterError
from sdk import AsyncClient, CompletionRequest, InvalidRequestError, RateLimited, Runtime, TenantPolicy
from sdk.hooks import Hook, RequestContext, RequestOrigin
from sdk.policy import ENGINE_MAX_TOKENS, request_terms
from sdk.prompt_worker import PromptWorker
from sdk.rate_limit import RateLimiter
from tests.support import fairness

SYSTEM = "You are the assistant of a public library. Opening hours are 9 am to 6 pm on weekdays. " * 3


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tiny_model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


# --------------------------------------------------------------------------- the terms


class _SixteenByDefault(CompletionRequest):
    default_max_tokens = 16


def test_terms_give_a_request_types_default_held_to_the_cap() -> None:
    """Without max_tokens: the request type's default (None = the engine's), under a cap the smaller; asked: as asked."""
    capped = TenantPolicy(max_tokens=8)
    assert request_terms(None, None, CompletionRequest(prompt="x")).max_tokens is None
    assert request_terms(None, None, _SixteenByDefault(prompt="x")).max_tokens == 16
    assert request_terms(capped, None, _SixteenByDefault(prompt="x")).max_tokens == 8
    assert request_terms(TenantPolicy(max_tokens=1000), None, CompletionRequest(prompt="x")).max_tokens == ENGINE_MAX_TOKENS
    assert request_terms(capped, None, _SixteenByDefault(prompt="x", max_tokens=5)).max_tokens == 5
    with pytest.raises(InvalidRequestError, match="at most 8") as err:
        request_terms(capped, None, CompletionRequest(prompt="x", max_tokens=9))
    assert err.value.param == "max_tokens"


# --------------------------------------------------------------------------- the limiter


def test_a_burst_of_1000_admits_exactly_the_minute_and_refills() -> None:
    """requests_per_minute=100: of 1,000 at once exactly 100 enter; the counters are back to full a minute later."""
    clock = Clock()
    limiter = RateLimiter(TenantPolicy(requests_per_minute=100), clock)
    leases, refused = [], []
    for _ in range(1000):
        try:
            leases.append(limiter.enter())
        except RateLimited as exc:
            refused.append(exc)
    assert len(leases) == 100 and len(refused) == 900
    assert refused[0].retry_after == pytest.approx(0.6) and refused[0].state.requests.remaining == 0
    for lease in leases:
        lease.release(0)
    assert limiter.num_in_flight == 0
    clock.now += 60
    state = limiter.state()
    assert (state.requests.limit, state.requests.remaining, state.requests.reset) == (100, 100, 0.0)


def test_tokens_are_reserved_then_the_unused_given_back() -> None:
    """tokens_per_minute=1000: reservations of 300 admit three, a fourth is refused; releasing returns what went unused."""
    clock = Clock()
    limiter = RateLimiter(TenantPolicy(tokens_per_minute=1000, requests_per_minute=10), clock)
    leases = [limiter.enter() for _ in range(3)]
    for lease in leases:
        lease.take_tokens(300)
    fourth = limiter.enter()
    with pytest.raises(RateLimited, match="tokens_per_minute") as err:
        fourth.take_tokens(300)
    assert err.value.retry_after == pytest.approx(200 / (1000 / 60))
    fourth.release(0)
    assert limiter.state().requests.remaining == 7  # the refused request was given back
    leases[0].release(100)
    assert limiter.state().tokens.remaining == 300
    with pytest.raises(InvalidRequestError, match="tokens_per_minute is 1000") as bad:
        limiter.enter().take_tokens(1001)
    assert bad.value.param == "max_tokens"


def test_concurrency_holds_and_returns_to_zero() -> None:
    """max_concurrent_requests=3: the fourth concurrent request is refused until one ends."""
    limiter = RateLimiter(TenantPolicy(max_concurrent_requests=3))
    leases = [limiter.enter() for _ in range(3)]
    with pytest.raises(RateLimited, match="max_concurrent_requests is 3"):
        limiter.enter()
    leases.pop().release(0)
    leases.append(limiter.enter())
    for lease in leases:
        lease.release(0)
        lease.release(0)  # idempotent
    assert limiter.num_in_flight == 0


def test_policy_fields_are_knobs_with_bounds() -> None:
    """A policy value of the wrong type or out of bounds is a ParameterError naming the field."""
    for field, value in [("priority", "high"), ("weight", 0.0), ("requests_per_minute", 0), ("isolate_cache", 1)]:
        with pytest.raises(ParameterError) as err:
            TenantPolicy(**{field: value})
        assert err.value.param == field


def test_prompt_worker_takes_tenants_in_turn() -> None:
    """Five jobs of tenant a queued before one of tenant b: b's runs second, not sixth."""
    worker = PromptWorker(num_threads=1)
    order: list[str] = []
    gate = asyncio.Event()

    async def go() -> None:
        loop = asyncio.get_running_loop()
        blocker = asyncio.ensure_future(worker.run("a", lambda: asyncio.run_coroutine_threadsafe(gate.wait(), loop).result()))
        await asyncio.sleep(0.05)
        jobs = [asyncio.ensure_future(worker.run("a", order.append, f"a{i}")) for i in range(5)]
        jobs.append(asyncio.ensure_future(worker.run("b", order.append, "b0")))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(blocker, *jobs)

    asyncio.run(go())
    assert order == ["a0", "b0", "a1", "a2", "a3", "a4"]


# --------------------------------------------------------------------------- the client


async def test_priority_cap_max_tokens_cap_and_origin(make_client, fake_engine) -> None:
    """A policy's priority is the default and the cap; max_tokens is capped; hooks see the tenant, address and headers."""
    seen: list[RequestContext] = []

    class Record(Hook):
        async def on_request(self, ctx: RequestContext) -> None:
            seen.append(ctx)

    client = make_client(tenant="t", policy=TenantPolicy(priority=5, max_tokens=3), hooks=[Record()])
    with pytest.raises(InvalidRequestError, match="may ask for 5 or later") as err:
        await client.chat("hi", priority=4)
    assert err.value.param == "priority"
    with pytest.raises(InvalidRequestError, match="at most 3") as err:
        await client.chat("hi", max_tokens=4)
    assert err.value.param == "max_tokens"
    assert seen == [] and fake_engine.requests_seen == []  # refused before the hooks and the engine
    origin = RequestOrigin("10.0.0.7", {"x-request-source": "batch"})
    result = await client.chat("hi", origin=origin)
    assert result.usage.completion_tokens == 3  # the cap is the default
    await client.chat("hi", priority=9, max_tokens=1)
    assert [(c.tenant, c.client_address, dict(c.headers)) for c in seen[:1]] == [("t", "10.0.0.7", {"x-request-source": "batch"})]
    assert seen[1].headers == {} and seen[0].params["max_tokens"] == 3


async def test_a_prompt_past_max_model_len_is_refused_by_its_characters(make_client, fake_engine) -> None:
    """A 3.5 MB prompt is a 400 naming the limit before any hook runs or any token is computed."""
    calls = []

    class Record(Hook):
        async def on_request(self, ctx: RequestContext) -> None:
            calls.append(ctx)

    client = make_client(hooks=[Record()])
    for send in (lambda big: client.chat(big), lambda big: client.complete(big)):
        start = time.perf_counter()
        with pytest.raises(InvalidRequestError, match=r"prompt has 3500000 characters; at most \d+ can fit max_model_len") as err:
            await send("x" * 3_500_000)
        assert time.perf_counter() - start < 0.1 and err.value.param == "prompt"
    assert calls == [] and fake_engine.requests_seen == []


async def test_rate_limited_requests_are_refused_without_reaching_the_engine(make_client, fake_engine) -> None:
    """requests_per_minute=5 and 20 requests at once: 5 results, 15 RateLimited; nothing stays in flight."""
    client = make_client(tenant="t", policy=TenantPolicy(requests_per_minute=5, tokens_per_minute=10_000))
    results = await asyncio.gather(*(client.chat("hi", max_tokens=2) for _ in range(20)), return_exceptions=True)
    assert sum(isinstance(r, RateLimited) for r in results) == 15 and len(fake_engine.requests_seen) == 5
    assert client.limiter.num_in_flight == 0
    used = sum(r.usage.total_tokens for r in results if not isinstance(r, Exception))
    remaining = client.limiter.state().tokens.remaining  # each reserved prompt + 2, the unused given back
    assert 10_000 - used <= remaining <= 10_000 - used + 20  # a refill of 167 tokens a second may add


# --------------------------------------------------------------------------- the real engine


async def _blocks_of(engine: AsyncEngine, req_id: str) -> list[int]:
    return await engine.call(lambda e: e.kv.get_block_ids(req_id)[0])  # the one KV cache group


async def test_isolated_tenants_share_no_blocks_and_each_shares_its_own(tiny_model) -> None:
    """Identical system prompts: two isolated tenants share zero KV blocks; two requests of one tenant share them."""
    async with AsyncEngine(tiny_model, num_blocks=256, block_size=16) as engine:
        runtime = Runtime(engine=engine)
        policy = TenantPolicy(isolate_cache=True)
        a = AsyncClient(runtime=runtime, tenant="a", policy=policy)
        b = AsyncClient(runtime=runtime, tenant="b", policy=policy)
        conversation = [("system", SYSTEM), ("user", "When do you open?")]
        held: dict[str, list[int]] = {}

        async def hold(client: AsyncClient, name: str) -> Any:
            stream = client.stream(conversation, request_id=name, max_tokens=40, ignore_eos=True)
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    if name not in held and delta.token_ids:
                        held[name] = await _blocks_of(engine, name)
            return delta.usage

        a1 = await hold(a, "a1")
        usages = await asyncio.gather(hold(a, "a2"), hold(b, "b1"))  # both run at once
        assert a1.cached_tokens == 0
        assert usages[0].cached_tokens >= 16 and usages[1].cached_tokens == 0
        assert set(held["a2"]) & set(held["a1"])  # a's requests share its blocks
        assert not set(held["b1"]) & (set(held["a1"]) | set(held["a2"]))  # b shares none of them
        assert engine.stats()["kv_blocks_used"] == 0


async def test_a_burst_does_not_multiply_another_tenants_ttft(tiny_model) -> None:
    """Tenant a sends 500 requests at once; b's 10 during the burst: b's p99 TTFT within 3x of b alone; all of a's complete."""
    async with AsyncEngine(tiny_model, **fairness.ENGINE_CONFIG) as engine:
        with fairness.fixed_time_steps(engine):
            runtime = Runtime(engine=engine)
            a = AsyncClient(runtime=runtime, tenant="a", policy=TenantPolicy())
            b = AsyncClient(runtime=runtime, tenant="b", policy=TenantPolicy())

            async def burst_one(i: int) -> int:
                result = await a.chat(f"Question {i}?", max_tokens=fairness.BURST_MAX_TOKENS, **fairness.GREEDY)
                return result.usage.completion_tokens

            async def probe_one(i: int) -> float:
                start = time.perf_counter()
                stream = b.stream(f"Probe {i}?", max_tokens=fairness.PROBE_MAX_TOKENS, **fairness.GREEDY)
                async with contextlib.aclosing(stream):
                    ttft = None
                    async for delta in stream:
                        if ttft is None and delta.token_ids:
                            ttft = time.perf_counter() - start
                assert ttft is not None
                return ttft

            def num_in_engine() -> int:
                stats = engine.stats()
                return stats["num_requests_waiting"] + stats["num_requests_running"]

            await probe_one(-1)  # warm up both paths (templates, first steps)
            await burst_one(-1)
            alone = await fairness.run_workload(None, probe_one, num_in_engine)
            busy = await fairness.run_workload(burst_one, probe_one, num_in_engine)
    assert busy.num_burst_completed == fairness.NUM_BURST
    assert busy.probe_p99 <= 3 * alone.probe_p99, (busy.probe_ttfts, alone.probe_ttfts)


def test_the_framework_adapters_hold_requests_to_the_tenants_policy(fake_runtime, fake_engine) -> None:
    """PagedChat (LangChain) and PagedLLM (LlamaIndex) take a policy: its max_tokens caps and defaults their calls."""
    from llama_index.core.llms import ChatMessage as LIChatMessage

    from sdk.integrations.langchain import PagedChat
    from sdk.integrations.llamaindex import PagedLLM

    policy = TenantPolicy(max_tokens=2, priority=3)
    chat = PagedChat(runtime=fake_runtime, tenant="t", policy=policy, max_tokens=None)
    assert chat.invoke("hi").usage_metadata["output_tokens"] == 2
    with pytest.raises(InvalidRequestError, match="at most 2"):
        chat.invoke("hi", max_tokens=3)
    llm = PagedLLM(runtime=fake_runtime, tenant="t", policy=policy)
    with pytest.raises(InvalidRequestError, match="may ask for 3 or later"):
        llm.chat([LIChatMessage(role="user", content="hi")], priority=1)
    assert llm.chat([LIChatMessage(role="user", content="hi")]).raw["usage"]["completion_tokens"] == 2
    assert len(fake_engine.requests_seen) == 2  # the refused calls never reached the engine
