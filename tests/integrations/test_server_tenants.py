"""Tenants over HTTP on a scripted engine: the policy file, caps and rate limits under a burst, headers, hooks, stalls."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from integrations.openai_server.app import create_app
from integrations.openai_server.command import load_hooks
from integrations.openai_server.policy import PolicyError, ServerPolicy, key_digest
from integrations.openai_server.serving import Serving
from integrations.openai_server.state import STATE
from sdk import AsyncClient, RateLimited, TenantPolicy
from sdk.hooks import Hook, RegexFilter, RequestContext
from tests.integrations.fake_engine import FakeEngine
from tests.support.hooks import BLOCKED_WORD
from tests.support.serve_process import serve_process

CHAT = "/v1/chat/completions"
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

POLICY_FILE = f"""
[default]
requests_per_minute = 1000

[tenants.alice]
keys = ["sk-alice"]
requests_per_minute = 100
max_tokens = 8

[tenants.bob]
keys = ["sha256:{key_digest('sk-bob')}"]
priority = 3
max_concurrent_requests = 8
routes = ["{CHAT}", "/v1/models"]

[tenants.carol]
keys = ["sk-carol"]
models = ["another-model"]
"""


class Clock:
    """A clock that moves only when the test moves it (from now on: the limiter's buckets were stamped with now)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


class GatedEngine(FakeEngine):
    """A FakeEngine whose requests wait for ``gate`` before their first token."""

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        self.gate = asyncio.Event()
        self.max_running = 0

    async def stream(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        stream = super().stream(*args, **kwargs)
        first = await anext(stream)
        self.max_running = max(self.max_running, len(self.running))
        await self.gate.wait()
        yield first
        async for out in stream:
            yield out


class Recorder(Hook):
    def __init__(self) -> None:
        self.seen: list[RequestContext] = []

    async def on_request(self, ctx: RequestContext) -> None:
        self.seen.append(ctx)


@pytest.fixture
def policy(tmp_path) -> ServerPolicy:
    path = tmp_path / "tenants.toml"
    path.write_text(POLICY_FILE)
    return ServerPolicy.load(path)


@pytest.fixture
def serve(live_server, tokenizer, policy):
    """``serve(engine_cls=FakeEngine, **app_kwargs)`` -> (LiveServer, engine)."""

    def make(engine_cls: type = FakeEngine, hooks: tuple = (), **kwargs: Any):
        engine = engine_cls(tokenizer)
        app = create_app(policy=policy, serving_factory=lambda: Serving(engine, hooks=hooks), **kwargs)
        return live_server(app), engine

    return make


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


async def _post_many(
    server, key: str, count: int, body: dict, path: str = CHAT, *, hold: tuple[int, Any] | None = None
) -> list[tuple[int, dict, dict]]:
    """``count`` POSTs at once; ``hold=(n, release)`` calls ``release()`` once ``n`` have answered (or after 30 s)."""
    connector = aiohttp.TCPConnector(limit=200)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one() -> tuple[int, dict, dict]:
            async with http.post(server.root + path, json=body, headers=_headers(key)) as resp:
                return resp.status, dict(resp.headers), await resp.json()

        tasks = [asyncio.ensure_future(one()) for _ in range(count)]
        if hold is not None:
            num_answered, release = hold
            deadline = time.monotonic() + 30
            while sum(t.done() for t in tasks) < num_answered and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            release()
        return await asyncio.gather(*tasks)


def _limiter(server, tenant: str):
    state = server.app[STATE]
    return state.serving.client(tenant, state.policy.tenant(tenant).policy).limiter


# --------------------------------------------------------------------------- the policy file


def test_the_policy_file_reads_hashed_keys_and_refuses_typos(tmp_path, policy) -> None:
    """Plain and sha256: keys authenticate the same way; an unknown or out-of-bounds field names itself and the file."""
    assert policy.key_table() == {key_digest("sk-alice"): "alice", key_digest("sk-bob"): "bob", key_digest("sk-carol"): "carol"}
    assert policy.tenant("bob").policy == TenantPolicy(priority=3, max_concurrent_requests=8)
    assert policy.default.requests_per_minute == 1000
    path = tmp_path / "bad.toml"
    for text, message in [
        ('[tenants.x]\nkeys = ["k"]\nrequest_per_minute = 5', "tenants.x.request_per_minute: unknown field"),
        ('[tenants.x]\nkeys = ["k"]\nweight = 0', "tenants.x.weight must be in (0, 1000000]"),
        ("[tenants.x]\npriority = 1", "tenants.x.keys: at least one key is needed"),
        ('[tenants.x]\nkeys = ["sha256:abc"]', "tenants.x.keys.0: a key, or sha256:"),
        ('[tenants.x]\nkeys = ["k"]\nroutes = ["/v2"]', "tenants.x.routes.0"),
        ('[tenants.x]\nkeys = ["k"]\n[tenants.y]\nkeys = ["k"]', "tenants.y.keys: a key another tenant has"),
        ("[default\n", "bad.toml"),
    ]:
        path.write_text(text)
        with pytest.raises(PolicyError, match=f"^{path}: .*" if message == "bad.toml" else f"{path}: .*{__import__('re').escape(message)}"):
            ServerPolicy.load(path)


def test_hook_factories_load_from_module_specs() -> None:
    """``--hook module:factory`` takes a Hook or a list of them; a bad spec is a ValueError naming it."""
    hooks = load_hooks(["tests.support.hooks:make_hooks", f"{__name__}:Recorder"])
    assert [type(h) for h in hooks] == [RegexFilter, Recorder]
    for spec in ("nocolon", "no.such.module:f", f"{__name__}:missing", f"{__name__}:Clock"):
        with pytest.raises(ValueError, match=spec.split(":")[0]):
            load_hooks([spec])


# --------------------------------------------------------------------------- caps and limits under a burst


async def test_a_burst_of_1000_gets_exactly_900_429s_and_the_counters_return(serve) -> None:
    """requests_per_minute=100, 1,000 at once: exactly 100 answered, 900 429s with Retry-After and x-ratelimit-* headers."""
    server, engine = serve()
    limiter = _limiter(server, "alice")
    limiter.clock = clock = Clock()
    results = await _post_many(server, "sk-alice", 1000, HI)
    statuses = Counter(status for status, _, _ in results)
    assert statuses == {200: 100, 429: 900} and engine.num_finished == 100
    refused = next(r for r in results if r[0] == 429)
    assert refused[2]["error"]["code"] == "rate_limit_exceeded" and refused[2]["error"]["type"] == "rate_limit_error"
    assert refused[1]["Retry-After"] == "1"  # 0.6 s to the next request, rounded up
    assert refused[1]["x-ratelimit-limit-requests"] == "100" and refused[1]["x-ratelimit-remaining-requests"] == "0"
    assert refused[1]["x-ratelimit-reset-requests"] == "1m0s"
    assert _limiter(server, "alice").num_in_flight == 0
    async with AsyncClient(base_url=server.root + "/v1", api_key="sk-alice") as remote:  # the SDK reads the same answer
        with pytest.raises(RateLimited, match="requests_per_minute") as err:
            await remote.chat("hi", max_tokens=2)
    assert err.value.retry_after == 1.0
    clock.now += 60
    (status, headers, _), = await _post_many(server, "sk-alice", 1, HI)
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "99" and headers["x-ratelimit-reset-requests"] == "600ms"


async def test_concurrency_and_priority_caps_hold_under_a_burst(serve) -> None:
    """max_concurrent_requests=8 with 1,000 at once: exactly 8 run, 992 429s; a priority above the cap is a 400."""
    server, engine = serve(GatedEngine)
    release = (992, lambda: server.loop.call_soon_threadsafe(engine.gate.set))  # the eight hold until the rest answered
    statuses = Counter(status for status, _, _ in await _post_many(server, "sk-bob", 1000, HI, hold=release))
    assert statuses == {200: 8, 429: 992} and engine.max_running == 8
    assert _limiter(server, "bob").num_in_flight == 0 and not engine.running
    for priority, status in [(-2147483648, 400), (2, 400), (3, 200), (7, 200)]:
        (got, _, body), = await _post_many(server, "sk-bob", 1, {**HI, "priority": priority})
        assert got == status, body
        if status == 400:
            assert body["error"]["param"] == "priority" and "3 or later" in body["error"]["message"]


async def test_max_tokens_cap_models_and_routes(serve) -> None:
    """alice's max_tokens cap is the default and the limit; bob may not use /v1/completions; carol sees no model."""
    server, _ = serve()
    (status, _, body), = await _post_many(server, "sk-alice", 1, {**HI, "max_tokens": 9})
    assert status == 400 and body["error"]["param"] == "max_tokens" and "at most 8" in body["error"]["message"]
    (status, _, body), = await _post_many(server, "sk-alice", 1, {"messages": HI["messages"]})
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    (status, _, body), = await _post_many(server, "sk-alice", 1, {"prompt": "hi"}, "/v1/completions")
    assert status == 200 and body["usage"]["completion_tokens"] == 8  # OpenAI's 16, capped
    (status, _, body), = await _post_many(server, "sk-bob", 1, {"prompt": "hi"}, "/v1/completions")
    assert status == 403 and body["error"]["code"] == "route_not_allowed"
    (status, _, body), = await _post_many(server, "sk-carol", 1, {**HI, "model": "fake-model"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    async with aiohttp.ClientSession() as http:
        async with http.get(server.base_url + "/models", headers=_headers("sk-carol")) as resp:
            assert (await resp.json())["data"] == []


async def test_hooks_see_the_tenant_address_and_headers_without_credentials(serve) -> None:
    """Over HTTP a hook's context has the tenant, the peer address and the headers, minus Authorization and Cookie."""
    recorder = Recorder()
    server, _ = serve(hooks=(recorder,))
    async with aiohttp.ClientSession() as http:
        headers = {**_headers("sk-alice"), "X-Team": "search", "Cookie": "session=secret"}
        async with http.post(server.root + CHAT, json=HI, headers=headers) as resp:
            assert resp.status == 200
    (ctx,) = recorder.seen
    assert ctx.tenant == "alice" and ctx.client_address == "127.0.0.1" and ctx.headers["x-team"] == "search"
    assert not {"authorization", "cookie"} & set(ctx.headers)


# --------------------------------------------------------------------------- a request path no one can stall


def test_ten_huge_prompts_leave_a_serve_process_answering(tiny_model_factory, tmp_path) -> None:
    """A ``paged serve --policy --hook`` process: ten concurrent 3.5 MB prompts each get a 400 naming the limit while
    /health answers within 250 ms throughout; the policy's keys and the --hook filter hold."""
    (tmp_path / "tenants.toml").write_text(POLICY_FILE)
    flags = ["--model", str(tiny_model_factory("llama")), "--num-blocks", "64", "--log-level", "WARNING",
             "--policy", str(tmp_path / "tenants.toml"), "--hook", "tests.support.hooks:make_hooks"]  # fmt: skip
    with serve_process(*flags) as (_, root):
        asyncio.run(_flood(root))


# GET /health every 10 ms over one kept-alive connection until stdin closes, then print each latency (inf: not 200).
PROBE = """
import http.client, json, sys, threading, time
port, latencies, done = int(sys.argv[1]), [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
print("probing", flush=True)
while not done.is_set():
    start = time.perf_counter()
    conn.request("GET", "/health")
    resp = conn.getresponse()
    resp.read()
    latencies.append(time.perf_counter() - start if resp.status == 200 else float("inf"))
    time.sleep(0.01)
print(json.dumps(latencies))
"""


async def _flood(root: str) -> None:
    big = "x" * 3_500_000
    bodies = [(json.dumps({"messages": [{"role": "user", "content": big}]}).encode(), CHAT) for _ in range(5)]
    bodies += [(json.dumps({"prompt": big}).encode(), "/v1/completions") for _ in range(5)]
    async with aiohttp.ClientSession() as http:

        async def post(body: bytes, path: str, key: str = "sk-alice") -> tuple[int, dict]:
            async with http.post(root + path, data=body, headers=_headers(key)) as resp:
                return resp.status, await resp.json()

        # NOTE: the prober is a process of its own, so what it measures is the server's loop, not this
        # process's GIL while it sends 35 MB.
        probe = [sys.executable, "-c", PROBE, root.rsplit(":", 1)[1]]
        prober = subprocess.Popen(probe, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert prober.stdout.readline() == "probing\n"
        await asyncio.sleep(0.05)
        try:
            answers = await asyncio.gather(*(post(body, path) for body, path in bodies))
        finally:
            latencies = json.loads(prober.communicate(timeout=30)[0])
        assert len(latencies) >= 5 and max(latencies) < 0.25, sorted(latencies)[-3:]
        for status, body in answers:
            assert status == 400, body
            assert "prompt has 3500000 characters; at most 165888 can fit max_model_len (2048 tokens" in body["error"]["message"]
        assert {body["error"]["param"] for _, body in answers} == {"messages", "prompt"}
        blocked = json.dumps({"messages": [{"role": "user", "content": f"say {BLOCKED_WORD}"}], "max_tokens": 2}).encode()
        assert (await post(blocked, CHAT, "sk-nobody"))[0] == 401
        status, body = await post(blocked, CHAT)
        assert status == 400 and body["error"]["code"] == "content_filter"
        status, body = await post(json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), "/v1/completions", "sk-bob")
        assert status == 403


# --------------------------------------------------------------------------- any body, any route

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/v1/nothing"]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = ["model", "max_tokens", "priority", "n", "stream", "stop", "tools", "tool_choice", "cache_salt", "logprobs", "prompt"]
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | JSON},
    optional={"content": st.text(max_size=8) | JSON, "tool_calls": JSON, "tool_call_id": JSON, "name": JSON},
)
BODIES = st.one_of(
    JSON,
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4),
    st.builds(lambda messages, extra: {"messages": messages, "max_tokens": 2, **extra},
              st.lists(MESSAGE, max_size=3) | JSON, st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=3)),
)  # fmt: skip


@pytest.fixture(scope="module")
def any_body_server(tokenizer):
    from tests.integrations.conftest import LiveServer

    policy = ServerPolicy.from_dict(tomllib.loads(POLICY_FILE))
    live = LiveServer(create_app(policy=policy, serving_factory=lambda: Serving(FakeEngine(tokenizer)))).start()
    yield live
    live.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(route=st.sampled_from(ROUTES), method=st.sampled_from(["POST", "GET"]), body=BODIES,
       key=st.sampled_from(["sk-alice", "sk-bob", "sk-nope"]))  # fmt: skip
def test_any_json_body_on_any_route_is_never_a_500(any_body_server, route, method, body, key) -> None:
    """Arbitrary JSON to every route, with every kind of key: an answer or a 4xx OpenAI error body, never a 500."""
    request = urllib.request.Request(any_body_server.root + route, data=json.dumps(body).encode(), headers=_headers(key), method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    assert status < 500, (status, raw[:300])
    if status >= 400 and route != "/health":
        error = json.loads(raw)["error"]
        assert error["message"] and error["type"]
