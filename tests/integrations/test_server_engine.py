"""The server on the real engine (tiny random-weight model): official clients, LangChain, the SDK, disconnects, load."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

import aiohttp
import openai
import pytest

from integrations.openai_server.app import create_app
from integrations.openai_server.state import STATE

KEY = "sk-engine"
ENGINE_CONFIG = dict(num_blocks=512, block_size=16, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=512)


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    """One server over a tiny llama for the module (engine load is the slow part)."""
    from tests.integrations.conftest import LiveServer

    app = create_app(str(tiny_model_factory("llama")), api_key=KEY, **ENGINE_CONFIG)
    live = LiveServer(app).start()
    yield live
    live.stop()


def _stats(server) -> dict:
    return server.app[STATE].serving.stats()


def _idle(server, timeout: float = 1.0) -> bool:
    """Nothing running or waiting and every block free (or cached) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(server)
        if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0 and stats["kv_blocks_used"] == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=30)


def _model(server) -> str:
    return server.app[STATE].serving.model_name


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to five."}]


def test_sync_client_greedy_is_deterministic_and_honours_stop(server):
    """Greedy chat gives the same text twice; a stop string cuts the text before it; seeds reproduce samples."""
    client = _client(server)
    kwargs = dict(model=_model(server), messages=MESSAGES, max_tokens=12, temperature=0)
    first = client.chat.completions.create(**kwargs)
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 12
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first.choices[0].message.content
    text = first.choices[0].message.content
    stop = text[len(text) // 2 :][:3]
    if stop.strip():
        cut = client.chat.completions.create(**kwargs, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop" and stop not in cut.message.content
        assert text.startswith(cut.message.content)
    seeded = dict(kwargs, temperature=1.0, seed=7)
    texts = {client.chat.completions.create(**seeded).choices[0].message.content for _ in range(2)}
    assert len(texts) == 1
    assert _idle(server)


async def test_async_stream_equals_non_stream(server):
    """The streamed deltas of a greedy completion join to the non-streamed text; usage arrives at the end."""
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=30)
    kwargs = dict(model=_model(server), prompt="The quick brown fox", max_tokens=10, temperature=0)
    whole = await client.completions.create(**kwargs)
    stream = await client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    async for chunk in stream:
        parts.extend(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(parts) == whole.choices[0].text
    assert usage.completion_tokens == 10 and usage.prompt_tokens == whole.usage.prompt_tokens
    await client.close()


def test_langchain_chat_openai(server):
    """LangChain's ChatOpenAI works unchanged against the server: invoke, stream, usage and finish reason."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=_model(server), base_url=server.base_url, api_key=KEY, max_tokens=6, temperature=0, max_retries=0)
    reply = chat.invoke([("system", "You are terse."), ("human", "Count to five.")])
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.usage_metadata["output_tokens"] == 6 and reply.usage_metadata["input_tokens"] > 0
    streamed = "".join(chunk.content for chunk in chat.stream([("system", "You are terse."), ("human", "Count to five.")]))
    assert streamed == reply.content


async def test_sdk_over_http_matches_in_process(server):
    """sdk.AsyncClient over HttpTransport returns the same greedy text, token ids and usage as the in-process client."""
    from sdk.client import AsyncClient
    from sdk.http_transport import HttpTransport
    from sdk.transport import InProcessTransport

    transport = HttpTransport(server.base_url, api_key=KEY)
    remote = AsyncClient(transport=transport)
    local = AsyncClient(transport=InProcessTransport(server.app[STATE].serving.engine))
    try:
        a = await remote.chat(MESSAGES, max_tokens=8, temperature=0)
        b = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(local.chat(MESSAGES, max_tokens=8, temperature=0), server.loop))
        assert (a.text, a.token_ids, a.usage.prompt_tokens, a.usage.completion_tokens) == (
            b.text, b.token_ids, b.usage.prompt_tokens, b.usage.completion_tokens
        )  # fmt: skip
    finally:
        await transport.close()


def test_overlong_prompt_and_bad_params_are_400(server):
    """A prompt past max_model_len and a knob the engine refuses are BadRequestErrors; nothing is left allocated."""
    client = _client(server)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=_model(server), prompt=list(range(5, 700)), max_tokens=4)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=_model(server), prompt="hi", extra_body={"top_k": -5})
    assert err.value.body["param"] == "top_k"
    assert _idle(server)


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_frees_every_block_within_a_second(server, stream):
    """A client that closes after the first chunk (or mid-wait) leaves no request running and every block free."""
    body = {"model": _model(server), "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": stream}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        if stream:
            resp = await session.post(server.base_url + "/completions", json=body)
            assert (await resp.content.readline()).startswith(b"data: ")
            resp.close()
        else:
            # NOTE: a non-streamed answer only comes at the end, so the client gives up while waiting.
            waiting = asyncio.ensure_future(session.post(server.base_url + "/completions", json=body))
            await asyncio.sleep(0.3)
            assert _stats(server)["num_requests_running"] == 1
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
    assert await asyncio.to_thread(_idle, server, 1.0), _stats(server)


async def test_200_concurrent_streams_with_random_disconnects(server):
    """200 concurrent streams, a third dropped early at random: the rest finish, none is lost, no block leaks."""
    rng = random.Random(0)
    model = _model(server)
    done_before = _stats(server)["generation_tokens"]

    async def one(session: aiohttp.ClientSession, i: int) -> str:
        drop_after = rng.randint(1, 4) if rng.random() < 0.33 else None
        body = {"model": model, "prompt": f"Request {i}: tell me a story", "max_tokens": 8, "ignore_eos": True, "stream": True}
        async with session.post(server.base_url + "/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            events = 0
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    return "done"
                event = json.loads(line[6:])
                assert "error" not in event, event
                events += 1
                if drop_after is not None and events >= drop_after:
                    resp.close()
                    return "dropped"
        return "lost"

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers={"Authorization": f"Bearer {KEY}"}) as session:
        outcomes = await asyncio.wait_for(asyncio.gather(*(one(session, i) for i in range(200))), 120)
    assert "lost" not in outcomes and outcomes.count("done") > 100
    assert await asyncio.to_thread(_idle, server, 2.0), _stats(server)
    assert _stats(server)["generation_tokens"] - done_before >= 8 * outcomes.count("done")


def test_metrics_reflect_served_requests(server):
    """After traffic, /metrics shows generated tokens and TTFT observations, and zero blocks in use."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    _client(server).completions.create(model=_model(server), prompt="hello", max_tokens=3)
    request = urllib.request.Request(server.root + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        samples = {s.name: s.value for f in text_string_to_metric_families(resp.read().decode()) for s in f.samples if not s.labels or "le" not in s.labels}
    stats = _stats(server)
    assert samples["paged_generation_tokens_total"] == stats["generation_tokens"] > 0
    assert samples["paged_ttft_seconds_count"] >= 1
    assert samples["paged_kv_blocks_used"] == 0


def test_n_choices_share_the_prompt(server):
    """n=3 gives three indexed choices (greedy: each equal to the single answer), the prompt counted once in usage."""
    client = _client(server)
    kwargs = dict(model=_model(server), prompt="Numbers:", max_tokens=8, temperature=0)
    one = client.completions.create(**kwargs)
    many = client.completions.create(**kwargs, n=3)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert {c.text for c in many.choices} == {one.choices[0].text}
    assert many.usage.prompt_tokens == one.usage.prompt_tokens and many.usage.completion_tokens == 24
    assert _idle(server)


async def test_admission_limits_answer_429_on_the_real_engine(live_server, tiny_model_factory):
    """With one running and one queued slot, a burst gets 429s with Retry-After; the admitted ones finish."""
    app = create_app(str(tiny_model_factory("llama")), num_blocks=64, max_num_seqs=1, max_queued_requests=1)
    small = await asyncio.to_thread(live_server, app)
    body = {"model": _model(small), "prompt": "hi", "max_tokens": 30, "ignore_eos": True}

    async def one(session: aiohttp.ClientSession) -> tuple[int, str | None]:
        async with session.post(small.base_url + "/completions", json=body) as resp:
            await resp.read()
            return resp.status, resp.headers.get("Retry-After")

    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(one(session) for _ in range(6)))
    assert (429, "1") in results and any(status == 200 for status, _ in results)
    assert {status for status, _ in results} <= {200, 429}
    assert await asyncio.to_thread(_idle, small, 1.0)
