"""sdk.AsyncClient over HttpTransport against the real server: same results, usage and errors as in-process."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from integrations.openai_server.app import create_app
from integrations.openai_server.serving import Serving
from sdk.client import AsyncClient
from sdk.errors import ContentBlocked, InvalidRequestError, OverloadedError
from sdk.hooks import RegexFilter
from sdk.http_transport import HttpTransport
from sdk.transport import InProcessTransport
from sdk.types import TokenLogprob, TopLogprob
from tests.integrations.fake_engine import FakeEngine

KEY = "sk-transport"


@pytest.fixture
def make_server(live_server, tokenizer):
    def make(hooks=(), **engine_kwargs):
        engine = FakeEngine(tokenizer, **engine_kwargs)
        app = create_app(api_key=KEY, hooks=hooks, serving_factory=lambda: Serving(engine, hooks=hooks))
        return live_server(app), engine

    return make


@contextlib.asynccontextmanager
async def _remote(server, **kwargs):
    transport = HttpTransport(server.root, api_key=KEY)
    try:
        yield AsyncClient(transport=transport, **kwargs)
    finally:
        await transport.close()


async def test_chat_complete_and_stream_over_http(make_server, tokenizer):
    """chat/complete/stream return the server's text, token ids and usage; the model comes from /v1/models."""
    server, _ = make_server()
    async with _remote(server) as client:
        result = await client.chat("hi", max_tokens=3)
        assert result.model == "fake-model" and client.max_model_len == 256
        assert result.text == " ok ok ok" and result.finish_reason == "length"
        assert result.token_ids == tokenizer.encode(" ok ok ok", add_special_tokens=False)
        assert result.usage.completion_tokens == 3 and result.usage.prompt_tokens > 3
        ids = tokenizer.encode("hello there", add_special_tokens=False)
        completion = await client.complete(ids, max_tokens=2)
        assert completion.usage.prompt_tokens == len(ids) and completion.text == " ok ok"
        deltas = [d async for d in client.stream("hi", max_tokens=2)]
        assert "".join(d.text for d in deltas) == " ok ok" and deltas[-1].finish_reason == "length"


async def test_logprobs_and_prompt_ids_over_http_match_in_process(make_server, tokenizer):
    """Remote chat and completion deltas carry the same per-token logprobs and prompt ids as in-process ones."""
    server, _ = make_server()
    local = AsyncClient(transport=InProcessTransport(FakeEngine(tokenizer)))
    top = [TopLogprob(token=" ok", logprob=-0.5), TopLogprob(token="<x>", logprob=-1.5)]
    expected = [TokenLogprob(token=" ok", logprob=-0.5, top_logprobs=top)] * 2
    async with _remote(server) as remote:
        for inputs in ({"messages": "hi"}, {"prompt": "hello there"}):
            seen = []
            for client in (local, remote):
                deltas = [d async for d in client.stream(**inputs, max_tokens=2, logprobs=2)]
                assert [t for d in deltas for t in d.logprobs or ()] == expected
                assert deltas[0].prompt_token_ids and all(d.prompt_token_ids is None for d in deltas[1:])
                seen.append(deltas[0].prompt_token_ids)
            assert seen[0] == seen[1]
            result = await remote.complete("hello there", max_tokens=2, logprobs=0)
            assert [(t.token, t.logprob, t.top_logprobs) for t in result.logprobs] == [(" ok", -0.5, [])] * 2
        assert (await remote.chat("hi", max_tokens=2)).logprobs is None


async def test_remote_errors_map_to_sdk_errors(make_server):
    """429 -> OverloadedError, 400 -> InvalidRequestError with the server's param, a server-side filter -> ContentBlocked."""
    server, _ = make_server(hooks=[RegexFilter("secret")])
    async with _remote(server) as client:
        with pytest.raises(InvalidRequestError, match="max_model_len") as err:
            await client.chat("word " * 400)  # valid here, too long for the server's engine
        assert err.value.param == "messages"
        with pytest.raises(ContentBlocked):
            await client.chat("my secret")
    server2, _ = make_server(overloaded=True)
    async with _remote(server2) as client:
        with pytest.raises(OverloadedError):
            await client.chat("hi")


async def test_leaving_a_remote_stream_aborts_on_the_server(make_server):
    """Breaking out of a remote stream closes the connection; the server aborts the engine request."""
    server, engine = make_server(delay=0.02)
    async with _remote(server) as client:
        stream = client.stream("hi", max_tokens=500)
        async with contextlib.aclosing(stream):
            async for _ in stream:
                break
        for _ in range(100):
            if not engine.running:
                break
            await asyncio.sleep(0.01)
        assert not engine.running


def test_sync_client_over_http(make_server):
    """The sync sdk.Client (its own loop thread) works over HttpTransport: chat, stream and an early break."""
    from sdk.sync import Client

    server, engine = make_server(delay=0.01)
    client = Client(transport=HttpTransport(server.base_url, api_key=KEY))
    assert client.chat("hi", max_tokens=2).text == " ok ok"
    pieces = []
    for delta in client.stream("hi", max_tokens=300):
        pieces.append(delta.text)
        if len(pieces) == 2:
            break
    assert pieces == [" ok", " ok"]
    for _ in range(100):
        if not engine.running:
            break
        time.sleep(0.01)
    assert not engine.running


async def test_prefix_over_http_warms_the_server(make_server):
    """client.prefix() over HTTP sends the prefix once (advisory pin); requests using it still work."""
    server, engine = make_server()
    async with _remote(server) as client:
        async with await client.prefix("You are terse.") as system:
            assert system.num_tokens > 0 and engine.num_finished == 1
            reply = await client.chat([*system.messages, ("user", "hi")], max_tokens=1)
            assert reply.text == " ok"
