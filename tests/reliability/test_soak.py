"""Soak: thousands of random requests (SDK and loopback HTTP) with aborts, disconnects, timeouts and overload.

At the end the engine is quiescent, no asyncio task is left on either loop, and every request is
accounted for exactly once: each request the hooks saw has exactly one audit record, whose outcome
matches what its caller got. The CI form runs a few hundred requests; ``--run-slow`` runs thousands.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from engine import AsyncEngine
from tests.support.quiescence import assert_quiescent, running_tasks
from integrations.openai_server.app import create_app
from integrations.openai_server.serving import Serving
from sdk import AsyncClient
from sdk.hooks import AuditLog
from sdk.errors import InvalidRequestError, OverloadedError, PagedError, RequestTimeout
from sdk.hooks import Hook, RequestContext
from sdk.transport import InProcessTransport
from tests.integrations.conftest import LiveServer

logger = logging.getLogger(__name__)

SOAK_CONFIG = dict(
    num_blocks=96, block_size=4, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=96, max_queued_requests=40
)
WORDS = "the cat sat on a mat while seven quick brown foxes jumped over lazy dogs again".split()
SYSTEM = "You are a terse assistant. Answer in one short line."


class _Seen(Hook):
    """Records every request the hooks saw start: by request id (SDK) and by tenant (HTTP)."""

    fail_closed = False

    def __init__(self) -> None:
        self.ids: collections.Counter[str] = collections.Counter()

    async def on_request(self, ctx: RequestContext) -> None:
        self.ids[ctx.tenant if ctx.route == "http" else ctx.request_id] += 1


@dataclass
class Tally:
    """What the callers saw; ``outcome`` per key is served / aborted / rejected / failed / cancelled."""

    outcome: dict[str, str] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)  # key -> finish_reason of a served / aborted request
    tokens: dict[str, int] = field(default_factory=dict)

    def counts(self) -> collections.Counter[str]:
        return collections.Counter(self.outcome.values())


def _options(rng: random.Random) -> dict[str, Any]:
    options: dict[str, Any] = {"max_tokens": rng.randint(1, 12), "priority": rng.randint(-2, 2)}
    if rng.random() < 0.5:
        options["temperature"] = 0.0
    else:
        options.update(temperature=rng.uniform(0.3, 1.5), top_p=rng.uniform(0.5, 1.0), seed=rng.randint(0, 1000))
    if rng.random() < 0.2:
        options["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.3:
        options["ignore_eos"] = True
    if rng.random() < 0.05:
        options["temperature"] = -1.0  # invalid: rejected by the engine's validation
    return options


def _messages(rng: random.Random) -> list[dict[str, str]]:
    user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


async def _sdk_request(i: int, rng: random.Random, client: AsyncClient, engine: AsyncEngine, tally: Tally) -> None:
    key = f"s{i}"
    options = dict(_options(rng), request_id=key)
    action = rng.random()
    if action < 0.05:
        options["timeout"] = rng.uniform(0.001, 0.05)
    try:
        if action < 0.25:  # stream, maybe leave early or abort by id
            got = 0
            finish = None
            stream = client.stream(_messages(rng), **options)
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    got += len(delta.token_ids)
                    finish = delta.finish_reason or finish
                    if action < 0.12 and got >= 1:
                        await engine.abort(key)
                    if 0.12 <= action < 0.18 and got >= 1:
                        break  # leaving early aborts through aclose
            if finish is None:
                tally.outcome[key], tally.finish[key] = "aborted", "abort"
            else:
                tally.outcome[key] = "aborted" if finish == "abort" else "served"
                tally.finish[key], tally.tokens[key] = finish, got
            return
        call = client.chat(_messages(rng), **options) if action < 0.7 else client.complete(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))), **options
        )
        result = await call
        tally.outcome[key] = "aborted" if result.finish_reason == "abort" else "served"
        tally.finish[key], tally.tokens[key] = result.finish_reason, result.usage.completion_tokens
    except (InvalidRequestError, OverloadedError):
        tally.outcome[key] = "rejected"
    except RequestTimeout:
        tally.outcome[key], tally.finish[key] = "aborted", "abort"
    except PagedError:
        tally.outcome[key] = "failed"


async def _http_request(i: int, rng: random.Random, http: aiohttp.ClientSession, base: str, tally: Tally) -> None:
    key = f"h{i}"
    options = _options(rng)
    stream = rng.random() < 0.5
    body = dict(options, messages=_messages(rng), stream=stream)
    headers = {"Authorization": f"Bearer k{i}"}
    try:
        async with http.post(f"{base}/chat/completions", json=body, headers=headers) as resp:
            if resp.status in (400, 429):
                tally.outcome[key] = "rejected"
                return
            assert resp.status == 200, (resp.status, await resp.text())
            if not stream:
                data = await resp.json()
                finish = data["choices"][0]["finish_reason"]
                tally.outcome[key] = "aborted" if finish == "abort" else "served"
                tally.finish[key], tally.tokens[key] = finish, data["usage"]["completion_tokens"]
                return
            disconnect = rng.random() < 0.3
            finish = None
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    choice = (json.loads(line[6:])["choices"] or [{}])[0]
                    finish = choice.get("finish_reason") or finish
                if disconnect:
                    resp.close()  # the client goes away mid-stream
                    tally.outcome[key] = "disconnected"
                    return
            tally.outcome[key] = "aborted" if finish == "abort" else "served"
            tally.finish[key] = finish
    except aiohttp.ClientError:
        tally.outcome[key] = "disconnected"


async def _soak(model_dir: Any, tmp_path: Any, num_requests: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    audit_path = tmp_path / "audit.jsonl"
    audit, seen = AuditLog(audit_path), _Seen()
    hooks = [seen, audit]
    engine = AsyncEngine(str(model_dir), **SOAK_CONFIG)
    keys = {f"h{i}": f"k{i}" for i in range(num_requests)}
    app = create_app(api_key=keys, serving_factory=lambda: Serving(engine, hooks=hooks, owns_engine=False))
    server = LiveServer(app).start()
    server_tasks = server.call(_tasks())
    test_tasks = running_tasks()
    client = AsyncClient(transport=InProcessTransport(engine), hooks=hooks, max_retries=3)
    tally = Tally()
    limit = asyncio.Semaphore(48)
    start = time.perf_counter()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as http:

            async def one(i: int) -> None:
                sub = random.Random(rng.random())
                async with limit:
                    if sub.random() < 0.6:
                        key, task = f"s{i}", asyncio.ensure_future(_sdk_request(i, sub, client, engine, tally))
                    else:
                        key, task = f"h{i}", asyncio.ensure_future(_http_request(i, sub, http, server.base_url, tally))
                    if sub.random() < 0.08:  # the caller's task is cancelled at a random moment
                        await asyncio.sleep(sub.uniform(0.0, 0.05))
                        task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        tally.outcome.setdefault(key, "cancelled")

            await asyncio.gather(*(one(i) for i in range(num_requests)))
        elapsed = time.perf_counter() - start
        await assert_quiescent(engine, tasks_before=test_tasks, timeout=5.0)
        server.call(assert_quiescent(engine, tasks_before=server_tasks, timeout=5.0))
        stats = engine.stats()
    finally:
        server.stop()
        await engine.shutdown()
    return _account(audit_path, seen, tally, stats, num_requests, elapsed)


async def _tasks() -> set[asyncio.Task]:
    return running_tasks()


def _account(audit_path: Any, seen: _Seen, tally: Tally, stats: dict, num_requests: int, elapsed: float) -> dict:
    """Checks every request is accounted for exactly once; returns the figures."""
    num_records = AuditLog.verify(audit_path)
    records: dict[str, dict] = {}
    for line in audit_path.read_text().splitlines():
        record = json.loads(line)
        key = record["tenant"] if record["route"] == "http" else record["request_id"]
        assert key not in records, f"{key} audited twice"
        records[key] = record
    assert num_records == len(records) == sum(seen.ids.values())
    assert set(records) == set(seen.ids), "a request the hooks saw start has no audit record"
    assert max(seen.ids.values(), default=1) == 1
    for key, outcome in tally.outcome.items():
        record = records.get(key)
        if outcome in ("served", "aborted") and key in tally.finish:
            assert record is not None, f"{key} was {outcome} but is not audited"
            if key.startswith("s") and outcome == "served":
                assert record["finish_reason"] == tally.finish[key], (key, record, tally.finish[key])
                assert record["completion_tokens"] == tally.tokens[key], (key, record)
            if outcome == "aborted":
                assert record["finish_reason"] in ("abort", None) or record["error"] is not None, record
        elif outcome == "rejected" and record is not None:
            assert record["error"] in ("InvalidRequestError", "OverloadedError"), record
        elif outcome == "disconnected":
            assert record is not None, f"{key} disconnected mid-stream but is not audited"
    counts = tally.counts()
    accounted = sum(counts.values())
    figures = {
        "requests": num_requests,
        "served": counts["served"],
        "aborted": counts["aborted"] + counts["disconnected"] + counts["cancelled"],
        "rejected": counts["rejected"],
        "failed": counts["failed"],
        "lost": num_requests - accounted,
        "audit_records": num_records,
        "leaked_blocks": stats["kv_blocks_used"],
        "preemptions": stats["num_preemptions"],
        "seconds": round(elapsed, 1),
    }
    figures["errors"] = dict(collections.Counter(r["error"] for r in records.values() if r["error"]))
    assert figures["lost"] == 0 and figures["failed"] == 0 and figures["leaked_blocks"] == 0, figures
    return figures


async def test_soak_short(model_dir, tmp_path) -> None:
    """A few hundred random SDK and HTTP requests: quiescent at the end, each accounted for exactly once."""
    figures = await _soak(model_dir, tmp_path, num_requests=600, seed=1)
    logger.info("soak figures: %s", figures)
    assert figures["served"] > 200 and figures["aborted"] > 20


@pytest.mark.slow
async def test_soak_long(model_dir, tmp_path) -> None:
    """Three thousand random requests: the same promises over a long run (figures in docs/reliability.md)."""
    figures = await _soak(model_dir, tmp_path, num_requests=3000, seed=2)
    print(f"\nsoak figures: {figures}")
    assert figures["served"] > 1000
