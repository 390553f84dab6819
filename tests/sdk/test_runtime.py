"""Runtime: who owns an engine, sharing one between clients, closing, and the sync loop thread."""

from __future__ import annotations

import concurrent.futures.thread
import gc
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeAsyncEngine

from sdk import AsyncClient, Client, Runtime

ROOT = Path(__file__).resolve().parents[2]
ENGINE_CONFIG = dict(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256)
SYSTEM = "You are the assistant of a public library that opens at nine and closes at six on weekdays."


@pytest.fixture(scope="module")
def tiny_model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


async def test_clients_on_one_runtime_share_its_engine_and_prefix_cache(tiny_model):
    """Two clients given one runtime drive the same engine: the second is served the first's prompt from the cache."""
    async with Runtime(tiny_model, **ENGINE_CONFIG) as runtime:
        first, second = AsyncClient(runtime=runtime), AsyncClient(runtime=runtime)
        messages = [("system", SYSTEM), ("user", "When do you open?")]
        await first.chat(messages, max_tokens=2, temperature=0)
        result = await second.chat(messages, max_tokens=2, temperature=0)
        assert first.transport.engine is second.transport.engine is runtime.engine
        assert result.usage.cached_tokens >= 16
        await first.aclose()
        engine = runtime.engine
        assert engine.is_running  # a client leaves a runtime it was given open
    assert runtime.closed and not engine.is_running


def test_start_loads_the_engine_so_the_first_request_does_not(tiny_model, monkeypatch):
    """The warm-up: after ``Client.start()``, ``PagedChat.start()`` or LlamaIndex ``PagedLLM.start()`` the engine is
    loaded, and the first request loads nothing."""
    import sdk.runtime
    from sdk.integrations.langchain import PagedChat
    from sdk.integrations.llamaindex import PagedLLM

    loads: list[str | None] = []
    load = sdk.runtime._load
    monkeypatch.setattr(sdk.runtime, "_load", lambda state, model, *rest: (loads.append(model), load(state, model, *rest)))
    client = Client(tiny_model, **ENGINE_CONFIG)
    with Runtime(tiny_model, **ENGINE_CONFIG) as runtime:
        adapters = [PagedChat(runtime=runtime, max_tokens=1), PagedLLM(runtime=runtime, max_tokens=1)]
        client.start()
        for adapter in adapters:
            adapter.start()
        assert loads == [tiny_model, tiny_model]  # the client's own engine, then the shared runtime's
        monkeypatch.setattr(sdk.runtime, "_load", lambda *args: pytest.fail("a request loaded the engine"))
        assert client.chat("hi", max_tokens=1).usage.completion_tokens == 1
        assert adapters[0].invoke("hi").usage_metadata["output_tokens"] == 1
        assert adapters[1].complete("hi").additional_kwargs["usage"]["completion_tokens"] == 1
    client.close()


async def test_own_runtime_is_closed_by_aclose(tiny_model):
    """A client without runtime= owns one: aclose() shuts its engine down; later calls raise RuntimeError."""
    client = AsyncClient(tiny_model, **ENGINE_CONFIG)
    await client.chat("hi", max_tokens=1)
    engine = client.runtime.engine
    await client.aclose()
    assert client.runtime.closed and not engine.is_running
    with pytest.raises(RuntimeError, match="runtime is closed"):
        await client.chat("hi", max_tokens=1)


def test_sync_client_close_shuts_its_engine_and_loop_down(tiny_model):
    """Client.close() runs on the runtime's loop thread, then that runtime's engine and thread stop."""
    client = Client(tiny_model, **ENGINE_CONFIG)
    assert client.chat("hi", max_tokens=1).usage.completion_tokens == 1
    engine, thread = client.runtime.engine, client.runtime._state.thread
    client.close()
    thread.join(timeout=5)
    assert not engine.is_running and not thread.is_alive()
    with pytest.raises(RuntimeError, match="runtime is closed"):
        client.chat("hi", max_tokens=1)


async def test_garbage_collected_client_shuts_its_engine_down(tiny_model, monkeypatch):
    """Dropping the last reference to a client (inside a running event loop) shuts its own engine down, even while
    the pool thread that loaded the engine still holds its work item (as a descheduled one does)."""
    run = concurrent.futures.thread._WorkItem.run

    def run_then_linger(item: Any) -> None:
        run(item)
        time.sleep(0.3)

    monkeypatch.setattr(concurrent.futures.thread._WorkItem, "run", run_then_linger)
    client = AsyncClient(tiny_model, **ENGINE_CONFIG)
    await client.start()
    engine = client.runtime.engine
    del client
    gc.collect()
    assert not engine.is_running


def test_garbage_collected_runtime_stops_its_loop_thread(fake_engine):
    """A runtime whose loop thread ran, dropped without close(), stops the thread (and leaves a given engine)."""
    runtime = Runtime(engine=fake_engine)
    client = Client(runtime=runtime)
    assert client.chat("hi", max_tokens=2).usage.completion_tokens == 2
    thread = runtime._state.thread
    del client, runtime
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_engine_left_open_is_shut_down_at_exit(tiny_model):
    """A client never closed: its engine is shut down at interpreter exit (an earlier-registered handler sees it)."""
    script = f"""
import atexit
engines = []
atexit.register(lambda: print("running at exit:", engines[0].is_running))  # runs after the runtimes' finalizers
from sdk import Client
client = Client({tiny_model!r}, **{ENGINE_CONFIG!r})
client.chat("hi", max_tokens=1)
engines.append(client.runtime.engine)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "running at exit: False" in done.stdout and "shutdown failed" not in done.stderr, done.stderr


def test_with_block_closes_the_runtime(tiny_model):
    """``with Runtime(...)`` closes on exit: the engine it loaded stops and using it raises RuntimeError."""
    with Runtime(tiny_model, **ENGINE_CONFIG) as runtime:
        client = Client(runtime=runtime)
        client.chat("hi", max_tokens=1)
        engine = runtime.engine
        client.close()  # the client does not close a runtime it was given
        assert not runtime.closed
    assert runtime.closed and not engine.is_running
    runtime.close()  # idempotent
    with pytest.raises(RuntimeError, match="runtime is closed"):
        runtime.engine
    with pytest.raises(RuntimeError, match="runtime is closed"):
        client.chat("hi")


async def test_a_given_engine_outlives_its_runtime(fake_engine, monkeypatch):
    """Runtime(engine=...) never shuts the engine down; a client on the closed runtime raises RuntimeError."""
    stopped = []

    async def shutdown() -> None:
        stopped.append(True)

    monkeypatch.setattr(fake_engine, "shutdown", shutdown)
    runtime = Runtime(engine=fake_engine)
    client = AsyncClient(runtime=runtime)
    await client.chat("hi", max_tokens=1)
    await runtime.aclose()
    assert stopped == []
    with pytest.raises(RuntimeError, match="runtime is closed"):
        await client.chat("hi", max_tokens=1)


async def test_unhashable_engine_config_values_reach_the_engine(monkeypatch, tokenizer):
    """engine_config is passed to the engine as given: no key is built from it, so lists are fine."""
    loaded: list[tuple[Any, dict[str, Any]]] = []

    def load(model: Any, **config: Any) -> FakeAsyncEngine:
        loaded.append((model, config))
        return FakeAsyncEngine(tokenizer)

    monkeypatch.setattr("engine.AsyncEngine", load)
    async with AsyncClient("some-model", stop_token_ids=[1, 2], num_blocks=8) as client:
        assert (await client.chat("hi", max_tokens=2)).usage.completion_tokens == 2
    assert loaded == [("some-model", {"stop_token_ids": [1, 2], "num_blocks": 8})]


async def test_run_sync_from_the_loop_thread_raises(fake_engine):
    """A sync call made on the runtime's own loop thread raises instead of deadlocking."""
    runtime = Runtime(engine=fake_engine)

    async def nested() -> None:
        async def noop() -> None:
            pass

        runtime.run_sync(noop())

    with pytest.raises(RuntimeError, match="own loop thread"):
        runtime.run_sync(nested())
    runtime.close()
    with pytest.raises(RuntimeError, match="runtime is closed"):
        runtime.run_sync(nested())


def test_conflicting_settings_are_named(fake_engine):
    """runtime= with engine fields, base_url or transport, and engine= with model or fields, are refused (a model
    with runtime= names one of its chat models)."""
    runtime = Runtime(engine=fake_engine)
    with pytest.raises(ValueError, match=r"runtime and num_blocks both given"):
        AsyncClient("m", runtime=runtime, num_blocks=8)
    with pytest.raises(ValueError, match=r"runtime and base_url both given"):
        Client(runtime=runtime, base_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match=r"runtime and transport both given"):
        AsyncClient(runtime=runtime, transport=AsyncClient(runtime=runtime).transport)
    with pytest.raises(ValueError, match=r"engine and model, num_blocks both given"):
        Runtime("m", engine=fake_engine, num_blocks=8)
