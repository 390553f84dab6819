"""AsyncClient / Client over a fake engine: results, streaming, prefixes, aborts, timeouts, retries, errors."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from pydantic import ValidationError

from sdk import AsyncClient, ChatMessage, Client, ClientSettings, InvalidRequestError, OverloadedError, RequestTimeout
from sdk.chat_template import render_chat
from sdk.transport import InProcessTransport

USER = ChatMessage(role="user", content="Tell me a story.")


async def test_chat_reports_text_usage_and_finish(make_client, fake_engine, tokenizer):
    """chat() returns the engine's text with exact token counts and the finish reason."""
    client = make_client()
    result = await client.chat([USER], max_tokens=5)
    assert result.finish_reason == "length"
    assert result.token_ids == fake_engine.script_ids[:5]
    assert result.text == tokenizer.decode(fake_engine.script_ids[:5])
    assert result.usage.prompt_tokens == len(render_chat(tokenizer, [USER]))
    assert result.usage.completion_tokens == 5
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5
    assert result.message == ChatMessage(role="assistant", content=result.text)
    assert result.model == "fake-model"


async def test_stream_deltas_add_up_to_chat(make_client):
    """Streamed deltas concatenate to the chat text; only the last carries finish_reason and usage."""
    client = make_client()
    deltas = [d async for d in client.stream([USER], max_tokens=6)]
    assert len(deltas) == 6
    assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 6
    result = await client.chat([USER], max_tokens=6)
    assert "".join(d.text for d in deltas) == result.text


async def test_stop_string_ends_with_stop(make_client):
    """A stop string ends generation with finish_reason 'stop' and is not in the text."""
    result = await make_client().chat("hi", stop=["fox"], max_tokens=50)
    assert result.finish_reason == "stop"
    assert result.text == " The quick brown "


async def test_complete_takes_raw_text_and_token_ids(make_client, tokenizer):
    """complete() sends the prompt as given (no chat template), as text or token ids."""
    client = make_client()
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    by_text = await client.complete("Once upon a time", max_tokens=3)
    by_ids = await client.complete(ids, max_tokens=3)
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)
    assert by_text.text == by_ids.text


async def test_prefix_pins_and_counts_hits(make_client, fake_engine, tokenizer):
    """A pinned prefix is warmed, counted on requests that start with it, and unpinned on close."""
    client = make_client()
    system = "You are a terse assistant who answers in one word."
    async with await client.prefix(system) as handle:
        assert list(fake_engine.pins.values()) == [handle.token_ids]
        assert handle.messages == [ChatMessage(role="system", content=system)]
        await client.chat([*handle.messages, USER], max_tokens=2)
        await client.chat([USER], max_tokens=2)  # a different system prompt: no hit
        assert handle.num_requests == 1
        full_blocks = handle.num_tokens // fake_engine.block_size * fake_engine.block_size
        assert handle.num_hit_tokens == full_blocks > 0
        conversation = render_chat(tokenizer, [*handle.messages, USER])
        assert handle.matches(conversation)
    assert handle.closed and fake_engine.pins == {}


async def test_breaking_out_of_stream_aborts(make_client, fake_engine):
    """Leaving a stream early aborts the engine request and frees its blocks."""
    client = make_client()
    async with contextlib.aclosing(client.stream([USER], max_tokens=50)) as stream:
        async for delta in stream:
            request_id = delta.request_id
            break
    assert request_id in fake_engine.aborted
    assert fake_engine.stats()["kv_blocks_used"] == 0


async def test_batch_runs_concurrently_in_order(make_client):
    """batch() returns one result per conversation, in input order, and errors can be collected."""
    client = make_client()
    results = await client.batch(["a", "b", "c"], max_tokens=2)
    assert [r.usage.completion_tokens for r in results] == [2, 2, 2]
    mixed = await client.batch(["a", "b"], max_tokens=2, temperature=-1.0, return_exceptions=True)
    assert all(isinstance(r, InvalidRequestError) for r in mixed)


async def test_timeout_aborts(make_client, fake_engine):
    """A request past its timeout raises RequestTimeout and its blocks are freed."""
    fake_engine.step_delay = 0.05
    with pytest.raises(RequestTimeout):
        await make_client().chat([USER], max_tokens=100, timeout=0.2)
    assert fake_engine.stats()["kv_blocks_used"] == 0


async def test_overloaded_is_retried(make_client, fake_engine):
    """An overloaded engine is retried max_retries times, then OverloadedError is raised."""
    fake_engine.overloaded_times = 1
    assert (await make_client(max_retries=1).chat("hi", max_tokens=1)).finish_reason == "length"
    fake_engine.overloaded_times = 1
    with pytest.raises(OverloadedError):
        await make_client().chat("hi", max_tokens=1)


async def test_invalid_requests_are_typed(make_client, fake_engine):
    """Bad knobs, unknown options and over-long prompts raise InvalidRequestError naming the field; bad roles fail validation."""
    client = make_client()
    with pytest.raises(InvalidRequestError, match="temperature") as err:
        await client.chat("hi", temperature=-1.0)
    assert err.value.param == "temperature"
    with pytest.raises(InvalidRequestError, match="max_model_len") as err:
        await client.complete("word " * 600)
    assert err.value.param == "prompt"
    with pytest.raises(ValidationError):
        ChatMessage(role="wizard", content="x")
    with pytest.raises(InvalidRequestError) as err:
        await client.chat("hi", not_an_option=1)
    assert err.value.param == "not_an_option"


def test_sync_client_chat_and_stream(fake_engine):
    """The sync Client returns the same results and its stream closes cleanly when left early."""
    client = Client(transport=InProcessTransport(fake_engine))
    result = client.chat("hi", max_tokens=4)
    assert "".join(d.text for d in client.stream("hi", max_tokens=4)) == result.text
    fake_engine.step_delay = 0.01  # the request runs for seconds on the SDK thread, so it is live when closed
    stream = client.stream("hi", max_tokens=400)
    first = next(stream)
    stream.close()
    assert first.request_id in fake_engine.aborted
    assert client.stats()["kv_blocks_used"] == 0
    with client.prefix("Be brief.") as handle:
        client.chat([*handle.messages, ("user", "hi")], max_tokens=1)
        assert handle.num_requests == 1
    assert fake_engine.pins == {}


async def test_sync_client_inside_event_loop(fake_engine):
    """The sync Client works when called from a thread that runs an event loop (never nests asyncio.run)."""
    client = Client(transport=InProcessTransport(fake_engine))
    assert asyncio.get_running_loop().is_running()
    assert client.chat("hi", max_tokens=2).usage.completion_tokens == 2


async def test_dropped_prefix_handle_unpins(make_client, fake_engine):
    """A prefix handle garbage-collected without close() still unpins its blocks."""
    import gc

    handle = await make_client().prefix("Be brief.")
    assert len(fake_engine.pins) == 1
    del handle
    gc.collect()
    for _ in range(200):
        if not fake_engine.pins:
            break
        await asyncio.sleep(0.01)
    assert fake_engine.pins == {}


async def test_settings_given_whole_or_as_keywords(fake_runtime, fake_engine):
    """``settings=`` and the keywords build the same client; given together, or contradicting each other, they are refused."""
    settings = ClientSettings(runtime=fake_runtime, tenant="t", route="batch")
    assert AsyncClient(runtime=fake_runtime, tenant="t", route="batch").settings == settings
    assert ClientSettings.of(None, num_blocks=8, tenant="t").engine_config == {"num_blocks": 8}
    client = Client(settings=settings)
    assert client.settings is settings and client.runtime is fake_runtime
    assert client.chat("hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(ValueError, match="settings and model, tenant both given"):
        AsyncClient("other", settings=settings, tenant="u")
    with pytest.raises(ValueError, match="runtime and num_blocks both given"):
        ClientSettings(runtime=fake_runtime, engine_config={"num_blocks": 8})
    assert "secret" not in repr(ClientSettings(base_url="http://127.0.0.1:1", api_key="secret"))
