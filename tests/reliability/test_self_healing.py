"""Self-healing: a driver that dies is replaced by a fresh engine; with resume off, its requests end with a retryable error.

Each test kills the driver of an engine of its own with a fault in ``Scheduler.schedule``
(outside the per-step isolation), in process and behind a real server over HTTP, and checks
that every request ends, the fresh engine serves within 10 s with a whole block pool and
the dead engine is freed; a crash loop backs off and ends dead.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import weakref

import aiohttp
import pytest

import engine.async_engine as async_engine_module
from engine import AsyncEngine
from engine.errors import ParameterError
from engine.supervisor import CrashLoop, RestartPolicy
from integrations.openai_server.app import create_app
from integrations.openai_server.serving import Serving
from sdk import AsyncClient
from sdk.errors import EngineRestarting, from_wire
from sdk.http_transport import HttpTransport
from sdk.transport import InProcessTransport
from tests.integrations.conftest import LiveServer
from tests.reliability.conftest import ENGINE_CONFIG, stream_until_restart
from tests.support.faults import InjectedFault, inject_fault
from tests.support.quiescence import assert_quiescent

# The default policy but for the first delay (0.5 s) and resume (tests/reliability/test_resume.py).
FAST = RestartPolicy(backoff_s=0.05, resume=False)
PROMPTS = [list(range(300 + 37 * i, 300 + 37 * i + 5 + i % 7)) for i in range(32)]
NUM_TOKENS = 24  # more steps than the driver survives: no request finishes before the fault


def test_crash_loop_doubles_the_delay_within_the_window_and_gives_up_past_max_restarts() -> None:
    """Failures 1..3 of a window wait 0.5, 1, 2 s (capped); the 4th gives up; old failures leave the window."""
    loop = CrashLoop(RestartPolicy(max_restarts=3, window_s=60.0, backoff_s=0.5, max_backoff_s=1.5))
    assert [loop.next_delay(t) for t in (0.0, 1.0, 2.0, 3.0)] == [0.5, 1.0, 1.5, None]
    assert CrashLoop(RestartPolicy()).next_delay(0.0) == 0.5
    spaced = CrashLoop(RestartPolicy(max_restarts=1, window_s=10.0))
    assert [spaced.next_delay(t) for t in (0.0, 11.0, 22.0)] == [0.5, 0.5, 0.5]  # one failure per window
    assert CrashLoop(RestartPolicy(max_restarts=0)).next_delay(0.0) is None
    with pytest.raises(ParameterError, match="backoff_s") as err:
        RestartPolicy(backoff_s=-1.0)
    assert err.value.param == "backoff_s"


def test_engine_restarting_round_trips_the_wire() -> None:
    """The server's 503 body, or an error event mid-stream (HTTP 200), is EngineRestarting again on the client."""
    error = EngineRestarting("the engine driver died", retry_after=2.5)
    assert (error.status_code, error.code, error.retry_after) == (503, "engine_restarting", 2.5)
    body = {"message": error.public_message, "type": error.error_type, "param": None, "code": error.code}
    for status in (503, 200):
        again = from_wire(status, body)
        assert type(again) is EngineRestarting and again.retry_after == 1.0  # the server's Retry-After



async def test_killing_the_driver_mid_load_ends_every_request_and_a_fresh_engine_serves(model_dir, quiescent) -> None:
    """32 streams, the driver killed on its 4th step: streams that had tokens end with EngineRestarting, the
    others (max_retries) are retried and finish; a fresh engine serves within 10 s, the dead one is freed.
    A pin dies with its engine: its id unpins nothing of the fresh engine's."""
    engine = AsyncEngine(str(model_dir), restart=FAST, **ENGINE_CONFIG)
    try:
        dead = weakref.ref(engine.engine)
        old_pin = await engine.pin_prefix(PROMPTS[0])
        plain = AsyncClient(transport=InProcessTransport(engine))
        retrying = AsyncClient(transport=InProcessTransport(engine), max_retries=5)
        with inject_fault(engine, "schedule", after=3) as fault:
            start = time.monotonic()
            tasks = [asyncio.ensure_future(stream_until_restart(plain, p, NUM_TOKENS)) for p in PROMPTS[:8]]
            tasks += [asyncio.ensure_future(stream_until_restart(retrying, p, NUM_TOKENS)) for p in PROMPTS[8:]]
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20.0)
        elapsed = time.monotonic() - start
        assert fault.num_fired == 1
        for received, error in results[:8]:  # no retries: every one ends with the retryable error
            assert isinstance(error, EngineRestarting) and "injected fault in schedule" in str(error)
        for received, error in results[8:]:  # retried unless it had streamed tokens already
            assert (error is None and received == NUM_TOKENS) or (isinstance(error, EngineRestarting) and received > 0)
        assert sum(error is None for _, error in results[8:]) >= 8  # at most 16 run at once: the rest were retried
        assert elapsed < 10.0
        health = engine.health()
        assert (health.status, health.restarts) == ("running", 1) and "InjectedFault" in health.last_error
        assert engine.stats()["engine_restarts"] == 1
        result = await plain.complete(PROMPTS[0], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(result.token_ids) == 4
        new_pin = await engine.pin_prefix(PROMPTS[1])
        await engine.unpin_prefix(old_pin.pin_id)
        assert new_pin.pin_id != old_pin.pin_id and len(await engine.call(lambda e: e.pinned_prefix_ids())) == 1
        await engine.unpin_prefix(new_pin.pin_id)
        await quiescent(engine)  # the fresh engine's pool is whole
        stats = engine.stats()
        assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_total"] == ENGINE_CONFIG["num_blocks"]
        gc.collect()
        assert dead() is None, "the dead engine is still referenced"
    finally:
        await engine.shutdown()


async def test_a_clients_first_request_while_a_fresh_engine_starts(model_dir, monkeypatch) -> None:
    """A client whose first request comes while the fresh engine is still loading: without retries it gets the
    retryable EngineRestarting (the SDK's, as any request then), with max_retries it is retried until the engine
    serves and finishes; its start never needs the live engine."""
    engine = AsyncEngine(str(model_dir), restart=FAST, **ENGINE_CONFIG)
    loading = threading.Event()  # the fresh engine's load waits on it: the restart holds until the test sets it
    real_engine = async_engine_module.Engine

    def held_load(*args: object, **kwargs: object) -> object:
        loading.wait(timeout=120.0)
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(async_engine_module, "Engine", held_load)
    try:
        with inject_fault(engine, "schedule"):
            _, error = await stream_until_restart(AsyncClient(transport=InProcessTransport(engine)), PROMPTS[0], 4)
        assert isinstance(error, EngineRestarting) and engine.health().status == "restarting"
        with pytest.raises(EngineRestarting):
            await AsyncClient(transport=InProcessTransport(engine)).complete(PROMPTS[1], max_tokens=4)
        transport = InProcessTransport(engine)
        tried = asyncio.Event()
        generate = transport.generate

        def first_try(request: object) -> object:
            tried.set()
            return generate(request)

        transport.generate = first_try  # type: ignore[method-assign]
        retrying = AsyncClient(transport=transport, max_retries=12)
        pending = asyncio.ensure_future(retrying.complete(PROMPTS[2], max_tokens=4, temperature=0.0, ignore_eos=True))
        await asyncio.wait_for(tried.wait(), 60.0)  # its first try met the restart
        assert engine.health().status == "restarting"
        loading.set()
        result = await asyncio.wait_for(pending, 120.0)
        assert len(result.token_ids) == 4 and engine.health().restarts == 1
    finally:
        loading.set()
        await engine.shutdown()


async def test_server_reports_the_restart_and_serves_again_within_10s(model_dir) -> None:
    """Over HTTP: streams cut by the restart end with an engine_restarting event; /health says restarting (503),
    then serving (200) with the count; a remote SDK client with max_retries rides through; /metrics counts it."""
    engine = AsyncEngine(str(model_dir), restart=FAST, **ENGINE_CONFIG)
    app = create_app(serving_factory=lambda: Serving(engine))
    server = LiveServer(app).start()
    body = {"prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    remote = AsyncClient(transport=HttpTransport(server.base_url), max_retries=5)
    try:
        await remote.start()
        async with aiohttp.ClientSession() as http:

            async def http_stream() -> list[str]:
                async with http.post(f"{server.base_url}/completions", json=body) as resp:
                    assert resp.status == 200
                    return [line.decode().strip() async for line in resp.content if line.strip()]

            async def health() -> tuple[int, dict]:
                async with http.get(f"{server.root}/health") as resp:
                    return resp.status, await resp.json()

            assert await health() == (200, {"status": "serving", "restarts": 0, "last_error": None})
            streams = [asyncio.ensure_future(http_stream()) for _ in range(3)]
            while engine.stats()["num_requests_running"] < 3:
                await asyncio.sleep(0.01)
            with inject_fault(engine, "schedule", error=InjectedFault("scheduler bug")):
                start = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*streams), 2.0)
                status, report = await health()
                assert status == 503 and report["status"] == "restarting"
                assert report["last_error"] == "InjectedFault: scheduler bug"
                async with http.post(f"{server.base_url}/completions", json={**body, "stream": False}) as resp:
                    refused = resp.status, resp.headers.get("Retry-After"), (await resp.json())["error"]["code"]
                retried = await remote.complete(PROMPTS[1], max_tokens=4, temperature=0.0, ignore_eos=True)
                served_after = time.monotonic() - start
            assert refused == (503, "1", "engine_restarting")
            for lines in results:  # each stream ends with the retryable error event and [DONE], never hangs
                assert '"engine_restarting"' in lines[-2] and lines[-1] == "data: [DONE]"
            assert len(retried.token_ids) == 4 and served_after < 10.0
            assert await health() == (200, {"status": "serving", "restarts": 1, "last_error": "InjectedFault: scheduler bug"})
            async with http.get(f"{server.root}/metrics") as resp:
                assert "paged_engine_restarts_total 1.0" in await resp.text()
        await assert_quiescent(engine)
    finally:
        await remote.aclose()
        server.stop()
        await engine.shutdown()


async def test_a_crash_loop_backs_off_then_reports_dead(model_dir, monkeypatch, caplog) -> None:
    """A fault on every start: three tries 0.1, 0.2, 0.4 s apart, then /health says dead and requests get 503."""
    policy = RestartPolicy(max_restarts=3, backoff_s=0.1, resume=False)
    engine = AsyncEngine(str(model_dir), restart=policy, **ENGINE_CONFIG)
    app = create_app(serving_factory=lambda: Serving(engine))
    server = LiveServer(app).start()

    def fail_to_start(*args: object, **kwargs: object) -> None:
        raise InjectedFault("device lost")

    monkeypatch.setattr(async_engine_module, "Engine", fail_to_start)
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession() as http:
            with caplog.at_level(logging.WARNING, logger="engine.supervisor"):
                with inject_fault(engine, "schedule", after=2):
                    start = time.monotonic()
                    async with http.post(f"{server.base_url}/completions", json=body) as resp:
                        assert (resp.status, (await resp.json())["error"]["code"]) == (503, "engine_restarting")
                while engine.health().status != "dead":
                    assert time.monotonic() - start < 10.0, engine.health()
                    await asyncio.sleep(0.02)
                elapsed = time.monotonic() - start
            async with http.get(f"{server.root}/health") as resp:
                assert resp.status == 503
                assert await resp.json() == {"status": "dead", "restarts": 3, "last_error": "InjectedFault: device lost"}
            async with http.post(f"{server.base_url}/completions", json=body) as resp:
                assert (resp.status, (await resp.json())["error"]["code"]) == (503, "server_dead")
        delays = [r.getMessage() for r in caplog.records if r.getMessage().startswith("starting a fresh engine")]
        assert delays == [f"starting a fresh engine in {d:.2f} s" for d in (0.1, 0.2, 0.4)]
        assert elapsed >= 0.7
        assert engine.stats()["engine_restarts"] == 3
    finally:
        server.stop()
        await engine.shutdown()
