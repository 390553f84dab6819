"""The drain journal keeps Responses API requests too: one SIGTERM's drain cuts off is finished and stored by the next server.

A gate holds the driver once the response has a few tokens, so the drain times out on it: its
client gets ``request_journalled`` naming the response's id after the events it had. A second
server on the same ``kv_cache_dir`` replays the entry through its responder, and
``GET /v1/responses/{id}`` answers the whole response, equal to an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import aiohttp

from engine import AsyncEngine
from integrations.openai_server.app import create_app
from integrations.openai_server.journal import RequestJournal
from integrations.openai_server.state import STATE
from tests.integrations.conftest import LiveServer
from tests.reliability.conftest import ENGINE_CONFIG
from tests.support.quiescence import assert_quiescent

CONFIG = dict(ENGINE_CONFIG, num_blocks=512, max_model_len=256)
HELD_AT = 5  # output tokens the response has when the gate holds the driver
NUM_TOKENS = 24
DRAIN_S = 1.0
_WAIT_S = 60.0
BODY = {
    "instructions": "You are the support assistant of a hardware shop. Answer in short sentences.",
    "input": "Does the drill model 104 come with a spare battery?",
    "max_output_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True,
}  # fmt: skip


class HoldAtTokens:
    """Holds the driver at the first step after a request has ``num_tokens`` output tokens, until ``release()``."""

    def __init__(self, engine: AsyncEngine, num_tokens: int) -> None:
        self.held, self._released = threading.Event(), threading.Event()
        inner = engine.engine
        real = inner.runner.execute_model

        def gated(*args: Any, **kwargs: Any) -> Any:
            if not self.held.is_set() and any(r.num_output_tokens >= num_tokens for r in inner.scheduler.requests.values()):
                self.held.set()
                self._released.wait(_WAIT_S)
            return real(*args, **kwargs)

        inner.runner.execute_model = gated  # NOTE: looked up on every step: the swap lands between two

    def release(self) -> None:
        self._released.set()


async def response_events(http: aiohttp.ClientSession, url: str, started: asyncio.Event) -> list[dict[str, Any]]:
    """A streamed response's events (their JSON); sets ``started`` at its first text delta."""
    events = []
    async with http.post(url, json={**BODY, "stream": True}) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                if events[-1].get("type") == "response.output_text.delta":
                    started.set()
    return events


def output_text(response: dict[str, Any]) -> str:
    return "".join(c["text"] for item in response["output"] if item["type"] == "message" for c in item["content"])


async def test_a_response_the_drain_cuts_off_is_finished_and_stored_by_the_next_server(model_dir, tmp_path) -> None:
    """A streamed response still running at the drain's deadline is journalled (request_journalled naming its id);
    a server on the same kv_cache_dir finishes it under that id: GET /v1/responses/{id} is the uninterrupted run."""
    cache = tmp_path / "kv"
    first = LiveServer(create_app(str(model_dir), drain_journal=True, drain_timeout=DRAIN_S, kv_cache_dir=str(cache), **CONFIG))
    first.start()
    gate = HoldAtTokens(first.app[STATE].serving.engine, HELD_AT)
    stopping: asyncio.Future | None = None
    try:
        async with aiohttp.ClientSession() as http:
            started = asyncio.Event()
            stream = asyncio.ensure_future(response_events(http, f"{first.base_url}/responses", started))
            await asyncio.wait_for(started.wait(), _WAIT_S)
            await asyncio.wait_for(asyncio.to_thread(gate.held.wait, _WAIT_S), _WAIT_S)
            stopping = asyncio.ensure_future(asyncio.to_thread(first.stop))  # the app's SIGTERM path: drain, then close
            events = await asyncio.wait_for(stream, _WAIT_S)
        gate.release()
        await asyncio.wait_for(stopping, _WAIT_S)
    finally:
        gate.release()
        if stopping is None:
            first.stop()
    response_id = events[0]["response"]["id"]
    error = events[-1]["error"]
    assert error["code"] == "request_journalled" and error["request_id"] == response_id, error
    sent = "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
    (entry,) = RequestJournal(cache / "journal").load()
    assert entry.request_id == response_id and entry.route == "response" and entry.text == sent and sent
    assert 0 < len(entry.token_ids) <= HELD_AT

    second = LiveServer(create_app(str(model_dir), drain_journal=True, kv_cache_dir=str(cache), **CONFIG))
    try:
        second.start()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{second.base_url}/responses/{response_id}") as resp:
                assert resp.status == 200, await resp.text()
                finished = await resp.json()
            async with http.post(f"{second.base_url}/responses", json={**BODY, "store": False}) as resp:
                reference = await resp.json()
        assert finished["id"] == response_id and finished["status"] == reference["status"] == "incomplete"  # its length
        assert finished["created_at"] == events[0]["response"]["created_at"]
        assert output_text(finished) == output_text(reference) and output_text(finished).startswith(sent)
        assert finished["usage"]["output_tokens"] == reference["usage"]["output_tokens"] == NUM_TOKENS
        assert finished["usage"]["input_tokens"] == reference["usage"]["input_tokens"]
        assert RequestJournal(cache / "journal").load() == []  # a replayed entry leaves the journal
        async with aiohttp.ClientSession() as http:  # NOTE: a stored response pins its conversation until deleted
            async with http.delete(f"{second.base_url}/responses/{response_id}") as resp:
                assert resp.status == 200
        await assert_quiescent(second.app[STATE].serving.engine)
    finally:
        second.stop()
