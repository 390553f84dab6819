"""Tenants over HTTP on the real engine (tiny model, fixed-time steps): fair share under a burst, cache isolation."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from engine import AsyncEngine
from integrations.openai_server.app import create_app
from integrations.openai_server.policy import ServerPolicy, Tenant
from integrations.openai_server.serving import Serving
from sdk import TenantPolicy
from tests.integrations.conftest import LiveServer
from tests.support import fairness

CHAT = "/v1/chat/completions"
SYSTEM = "You are the assistant of a public library. Opening hours are 9 am to 6 pm on weekdays. " * 3
ISOLATED = TenantPolicy(isolate_cache=True)
POLICY = ServerPolicy(
    tenants=(
        Tenant("a", ("sk-a",)), Tenant("b", ("sk-b",)),
        Tenant("iso1", ("sk-iso1",), ISOLATED), Tenant("iso2", ("sk-iso2",), ISOLATED),
    )
)  # fmt: skip


@pytest.fixture(scope="module")
def served(tiny_model_factory) -> Any:
    """(LiveServer, AsyncEngine): the server over a tiny llama whose steps take a fixed time."""
    with asyncio.Runner() as runner:
        engine = runner.run(_engine(str(tiny_model_factory("llama"))))
        with fairness.fixed_time_steps(engine):
            app = create_app(policy=POLICY, serving_factory=lambda: Serving(engine, owns_engine=False))
            server = LiveServer(app).start()
            yield server, engine
            server.stop()
        runner.run(engine.shutdown())


async def _engine(model: str) -> AsyncEngine:
    return AsyncEngine(model, **fairness.ENGINE_CONFIG)


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_burst_does_not_multiply_another_tenants_ttft(served) -> None:
    """Over HTTP: tenant a's 500 requests at once; b's 10 during the burst: b's p99 TTFT within 3x of b alone; all of a's complete."""
    server, engine = served
    # NOTE: b keeps its connections alive (opened by a first round of probes); a opens one per request.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=fairness.NUM_PROBES)) as b_http:  # fmt: skip

        async def burst_one(i: int) -> int:
            body = {"messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": fairness.BURST_MAX_TOKENS, **fairness.GREEDY}
            async with http.post(server.root + CHAT, json=body, headers=_headers("sk-a")) as resp:
                assert resp.status == 200, await resp.text()
                return (await resp.json())["usage"]["completion_tokens"]

        async def probe_one(i: int) -> float:
            body = {"messages": [{"role": "user", "content": f"Probe {i}?"}], "max_tokens": fairness.PROBE_MAX_TOKENS, "stream": True, **fairness.GREEDY}
            start = time.perf_counter()
            ttft = None
            async with b_http.post(server.root + CHAT, json=body, headers=_headers("sk-b")) as resp:
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    if ttft is None and line.startswith(b"data: {"):
                        ttft = time.perf_counter() - start  # the first event comes with the first token
            assert ttft is not None
            return ttft

        def num_in_engine() -> int:
            stats = engine.stats()
            return stats["num_requests_waiting"] + stats["num_requests_running"]

        await burst_one(-1)  # warm up both tenants' paths, and b's connections
        await fairness.run_workload(None, probe_one, num_in_engine)
        alone = await fairness.run_workload(None, probe_one, num_in_engine)
        busy = await fairness.run_workload(burst_one, probe_one, num_in_engine)
    assert busy.num_burst_completed == fairness.NUM_BURST
    assert busy.probe_p99 <= 3 * alone.probe_p99, (busy.probe_ttfts, alone.probe_ttfts)


async def test_isolated_tenants_share_no_cached_blocks(served) -> None:
    """Identical system prompts: an isolated tenant never hits another's blocks; its own second request does."""
    server, _ = served
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hours?"}], "max_tokens": 1}
    cached = []
    async with aiohttp.ClientSession() as http:
        for key in ("sk-iso1", "sk-iso2", "sk-iso1", "sk-iso2", "sk-a"):
            async with http.post(server.root + CHAT, data=json.dumps(body), headers=_headers(key)) as resp:
                usage = (await resp.json())["usage"]
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    full = usage["prompt_tokens"] // 16 * 16
    assert cached == [0, 0, full, full, 0]
