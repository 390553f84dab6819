"""/metrics after a mixed run over HTTP on the real engine: every documented metric, its type, counts that add up.

The run: two tenants, finishes by length and by a stop token, a preemption (a small KV cache),
a client that disconnects mid-stream (abort), a prompt the engine refuses (rejected); each
response's ``usage.latency`` and the audit record's ``latency_breakdown``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import AsyncEngine
from integrations.openai_server.app import create_app
from integrations.openai_server.serving import Serving
from sdk.hooks import AuditLog
from tests.integrations.conftest import LiveServer
from tests.support.metrics_docs import documented_metrics

COMPLETIONS = "/v1/completions"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PHASES = ("queue_s", "prefill_s", "decode_s")


@pytest.fixture(scope="module")
def served(tiny_model_factory, tmp_path_factory) -> Any:
    """(LiveServer, AsyncEngine, audit path): keys sk-a / sk-b for tenants a / b; 40 blocks of 4 tokens."""
    audit = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    with asyncio.Runner() as runner:
        engine = runner.run(_engine(str(tiny_model_factory("llama"))))
        runner_ = engine.engine.runner
        forward = runner_.execute_model

        def slow_forward(scheduler_output: Any) -> Any:
            time.sleep(0.005)  # a disconnect lands mid-generation, not after it
            return forward(scheduler_output)

        runner_.execute_model = slow_forward
        app = create_app(
            api_key={"a": "sk-a", "b": "sk-b"},
            serving_factory=lambda: Serving(engine, hooks=[AuditLog(audit)], owns_engine=False),
        )
        server = LiveServer(app).start()
        yield server, engine, audit
        server.stop()
        runner.run(engine.shutdown())


async def _engine(model: str) -> AsyncEngine:
    return AsyncEngine(model, num_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _scrape(http: aiohttp.ClientSession, root: str) -> dict[str, Any]:
    async with http.get(root + "/metrics", headers=_headers("sk-a")) as resp:
        assert resp.status == 200
        return {f.name: f for f in text_string_to_metric_families(await resp.text())}


def _value(families: dict[str, Any], name: str, **labels: str) -> float:
    family = families[name]
    sample_name = name + "_total" if family.type == "counter" else name
    return sum(s.value for s in family.samples if s.name == sample_name and labels.items() <= s.labels.items())


async def test_mixed_run_metrics_usage_and_audit(served) -> None:
    """Every documented metric appears with its type; received = success + aborted + unfinished; usage.latency adds up."""
    server, engine, audit = served
    async with aiohttp.ClientSession() as http:
        before = await _scrape(http, server.root)

        async def complete(key: str, prompt: list[int], **body: Any) -> dict[str, Any]:
            payload = {"prompt": prompt, "max_tokens": 24, "return_token_ids": True, **GREEDY, **body}
            async with http.post(server.root + COMPLETIONS, json=payload, headers=_headers(key)) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        # Six 20-token prompts of 24 tokens each, two tenants: 66 blocks wanted, 40 there: preemption.
        prompts = [list(range(300 + 40 * i, 320 + 40 * i)) for i in range(6)]
        burst = [asyncio.ensure_future(complete("sk-a" if i % 2 else "sk-b", p)) for i, p in enumerate(prompts)]
        during = None
        while not all(t.done() for t in burst):
            if during is None and engine.stats()["num_requests_running"] >= 4:
                during = await _scrape(http, server.root)
            await asyncio.sleep(0.01)
        lengths = [t.result() for t in burst]
        assert all(r["choices"][0]["finish_reason"] == "length" for r in lengths)
        assert during is not None
        tenants = {s.labels["tenant"] for s in during["paged_tenant_requests"].samples}
        assert tenants == {"a", "b"}

        # The same prompt again, stopping at its own second token: finish "stop".
        second = lengths[0]["choices"][0]["token_ids"][1]
        stopped = await complete("sk-a", prompts[0], stop_token_ids=[second])
        assert stopped["choices"][0]["finish_reason"] == "stop"
        latency = stopped["usage"]["latency"]
        assert latency["cached_prompt_tokens"] + latency["computed_prompt_tokens"] == 20
        assert sum(latency[k] for k in PHASES) == pytest.approx(latency["e2e_s"])

        # Streaming with include_usage: the final chunk has the breakdown; the prompt's 4 full blocks are cached.
        payload = {"prompt": prompts[0], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}, **GREEDY}
        async with http.post(server.root + COMPLETIONS, json=payload, headers=_headers("sk-b")) as resp:
            events = [json.loads(line[5:]) for line in (await resp.read()).decode().splitlines() if line.startswith("data: {")]
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == 4 and usage["latency"]["e2e_s"] > 0
        assert usage["latency"]["cached_prompt_tokens"] == 16 and usage["latency"]["computed_prompt_tokens"] == 4

        # A client that leaves mid-stream: the engine aborts its request.
        payload = {"prompt": list(range(2000, 2008)), "max_tokens": 100, "stream": True, **GREEDY}
        async with http.post(server.root + COMPLETIONS, json=payload, headers=_headers("sk-a")) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    break
        # A token id outside the vocabulary: refused at admission.
        async with http.post(server.root + COMPLETIONS, json={"prompt": [10**8], "max_tokens": 2}, headers=_headers("sk-b")) as resp:
            assert resp.status == 400
        deadline = time.monotonic() + 10
        while engine.stats()["requests_aborted"] - _value(before, "paged_requests_aborted") < 1:
            assert time.monotonic() < deadline, "the disconnected request was never aborted"
            await asyncio.sleep(0.02)
        after = await _scrape(http, server.root)

    for name, kind in documented_metrics().items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert family in after, f"{name} is documented but not exported"
        assert after[family].type == kind, f"{name}: exported as {after[family].type}, documented as {kind}"

    def grew(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    received = _value(after, "paged_requests_received")
    ended = _value(after, "paged_request_success") + _value(after, "paged_requests_aborted")
    unfinished = _value(after, "paged_num_requests_running") + _value(after, "paged_num_requests_waiting")
    assert received == ended + unfinished
    assert grew("paged_requests_received") == 9 and grew("paged_requests_aborted") == 1
    assert grew("paged_request_success", finished_reason="length") == 7
    assert grew("paged_request_success", finished_reason="stop") == 1
    assert grew("paged_requests_rejected") == 1
    assert grew("paged_num_preemptions") > 0 and grew("paged_kv_evictions") > 0
    assert grew("paged_tenant_computed_tokens", tenant="a") > 0 and grew("paged_tenant_computed_tokens", tenant="b") > 0
    e2e = [s for s in after["paged_e2e_request_latency_seconds"].samples if s.name.endswith("_count")]
    assert e2e[0].value == received - unfinished
    http_400 = [s for s in after["paged_http_requests"].samples if s.labels.get("status") == "400"]
    assert http_400, "the refused request is also an HTTP 400"

    records = [json.loads(line) for line in audit.read_text().splitlines()]
    by_reason = {r["finish_reason"]: r for r in records}
    breakdown = by_reason["stop"]["latency_breakdown"]
    assert breakdown == stopped["usage"]["latency"]
    assert by_reason["abort"]["latency_breakdown"] is None  # it never finished in the engine for the client
    assert AuditLog.verify(audit) == len(records)


def test_openai_client_reads_the_latency_extension(served) -> None:
    """The official openai client accepts usage.latency as an extra field."""
    server, _, _ = served
    resp = server.openai("sk-a").completions.create(
        model=server.model_name, prompt="Hello", max_tokens=3, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert resp.usage.completion_tokens == 3
    latency = resp.usage.model_extra["latency"]
    assert latency["decode_s"] >= 0 and latency["computed_prompt_tokens"] + latency["cached_prompt_tokens"] == resp.usage.prompt_tokens
