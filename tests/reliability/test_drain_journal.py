"""A restart that loses nothing it could keep: SIGTERM's drain journals what it cuts off, the next server finishes it.

The first server (``drain_journal``, a ``kv_cache_dir``) serves 16 chat streams sharing a
system prompt; its shutdown starts while they stream. A gate on the driver lets the short
ones finish and then holds the long ones, so the drain times out on exactly those: they are
journalled and their clients get ``request_journalled`` with the id. A second server on the
same port and directory loads the saved prefixes and replays the journal: each result, fetched
by id (openai SDK, and the paged SDK's ``retrieve``), is the whole answer an uninterrupted run
gives, its prompt served from the persisted cache; a corrupt entry and another model's are
skipped with a log line, and so is one whose tokens the engine refuses; no block is left referenced.
An SDK client with ``max_retries`` rides the restart: its stream goes on and ends with the whole answer.
Journalled completions replay past a full admission queue and answer at their own route.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine import AsyncEngine
from engine.errors import ParameterError
from integrations.openai_server.app import create_app
from integrations.openai_server.journal import JournalEntry, RequestJournal
from integrations.openai_server.state import STATE
from sdk import AsyncClient, RequestJournalled
from tests.integrations.conftest import LOOPBACK, LiveServer
from tests.reliability.conftest import ENGINE_CONFIG
from tests.support.quiescence import assert_quiescent

SYSTEM = (
    "You are the support assistant of a hardware shop. Answer in short sentences, name the product, "
    "never promise a delivery date and always end with a question."
)
SHORT, LONG = 4, 40  # max_tokens of the streams that finish within the drain, and of those it cuts off
DRAIN_S = 3.0
CONFIG = dict(ENGINE_CONFIG, num_blocks=512, max_model_len=256)
_WAIT_S = 60.0


class SamePort(LiveServer):
    """A ``LiveServer`` bound to a given port: the restarted server at the address its clients know."""

    def __init__(self, app: Any, port: int) -> None:
        super().__init__(app)
        self.port = port

    def start(self, wait_healthy: bool = True) -> LiveServer:
        from aiohttp import web

        self.thread.start()

        async def up() -> None:
            await self.runner.setup()
            await web.TCPSite(self.runner, LOOPBACK, self.port).start()

        self.call(up())
        if wait_healthy:
            self.wait_phase("serving")
        return self


class HoldOnceShortsLeave:
    """Holds the driver at the first step after all 16 requests came and every short one left: the long ones
    cannot finish until ``release()``."""

    def __init__(self, engine: AsyncEngine, num_requests: int) -> None:
        self.held, self._released = threading.Event(), threading.Event()
        inner = engine.engine
        real = inner.runner.execute_model

        def gated(*args: Any, **kwargs: Any) -> Any:
            shorts = any(r.sampling_params.max_tokens == SHORT for r in inner.scheduler.requests.values())
            if not self.held.is_set() and inner.request_stats.num_received >= num_requests and not shorts:
                self.held.set()
                self._released.wait(_WAIT_S)
            return real(*args, **kwargs)

        inner.runner.execute_model = gated  # NOTE: looked up on every step: the swap lands between two

    def release(self) -> None:
        self._released.set()


def chat_body(i: int, max_tokens: int) -> dict[str, Any]:
    question = f"Customer {i} asks: does the drill model {100 + i} come with a spare battery?"
    return {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip


async def sse_stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any], first: asyncio.Event) -> list[Any]:
    """A stream's events (JSON, then ``[DONE]``); sets ``first`` at its first chunk with a token."""
    events: list[Any] = []
    async with http.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            events.append("[DONE]" if data == "[DONE]" else json.loads(data))
            if events[-1] != "[DONE]" and any(c.get("token_ids") for c in events[-1].get("choices", ())):
                first.set()
    return events


def content(events: list[Any]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events if e != "[DONE]" for c in e.get("choices", ()))


async def test_sigterm_journals_the_cut_off_streams_and_a_second_server_finishes_them(model_dir, tmp_path, caplog) -> None:
    """16 streams at SIGTERM: the short finish, the long are journalled; a second server on the same kv_cache_dir
    completes them from the persisted prefixes, greedy-identical to an uninterrupted run, retrievable by id."""
    caplog.set_level(logging.INFO)
    cache = tmp_path / "kv"
    app = create_app(str(model_dir), drain_journal=True, drain_timeout=DRAIN_S, kv_cache_dir=str(cache), **CONFIG)
    first = LiveServer(app).start()
    gate = HoldOnceShortsLeave(first.app[STATE].serving.engine, 16)
    bodies = {i: chat_body(i, SHORT if i % 2 else LONG) for i in range(16)}
    remote = AsyncClient(base_url=first.base_url, max_retries=0)
    auto = AsyncClient(base_url=first.base_url, max_retries=6)
    stopping: asyncio.Future | None = None
    try:
        async with aiohttp.ClientSession() as http:
            firsts = {i: asyncio.Event() for i in bodies}
            url = f"{first.base_url}/chat/completions"
            streams = {i: asyncio.ensure_future(sse_stream(http, url, bodies[i], firsts[i])) for i in bodies if i not in (0, 2)}

            async def through_sdk(client: AsyncClient, i: int) -> tuple[str, list[int], BaseException | None]:
                text, token_ids = "", []
                try:
                    async for delta in client.stream(bodies[i]["messages"], max_tokens=LONG, temperature=0.0, ignore_eos=True):
                        text, token_ids = text + delta.text, token_ids + delta.token_ids
                        firsts[i].set()
                except RequestJournalled as exc:
                    return text, token_ids, exc
                return text, token_ids, None

            sdk_stream = asyncio.ensure_future(through_sdk(remote, 0))
            # NOTE: with max_retries the SDK re-attaches by itself: this stream goes on across the restart
            riding = asyncio.ensure_future(through_sdk(auto, 2))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts.values())), _WAIT_S)
            stopping = asyncio.ensure_future(asyncio.to_thread(first.stop))  # the app's SIGTERM path: drain, then close
            results = await asyncio.wait_for(asyncio.gather(*streams.values()), _WAIT_S)
            sdk_text, sdk_ids, journalled = await asyncio.wait_for(sdk_stream, _WAIT_S)
        gate.release()
        await asyncio.wait_for(stopping, _WAIT_S)
    finally:
        gate.release()
        if stopping is None:
            first.stop()
            await asyncio.gather(remote.aclose(), auto.aclose())
    by_index = dict(zip(streams, results))
    ids: dict[int, str] = {}
    for i, events in by_index.items():
        assert events[-1] == "[DONE]"
        if i % 2:  # short: finished within the drain
            assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
        else:  # long: cut off by the drain's deadline, journalled
            error = events[-2]["error"]
            assert error["code"] == "request_journalled" and error["request_id"] == events[0]["id"], error
            ids[i] = error["request_id"]
    assert isinstance(journalled, RequestJournalled) and sdk_ids
    ids[0] = journalled.request_id
    journal = RequestJournal(cache / "journal")
    journalled_ids = {e.request_id for e in journal.load()}
    assert len(journalled_ids) == 8 and set(ids.values()) < journalled_ids  # and the stream the SDK rides

    # a torn file, another model's entry and tokens the engine refuses: each skipped with a log line, start-up goes on
    (journal.directory / "torn.json").write_text('{"version": 1, "request_id": ')
    journal.write(JournalEntry("chatcmpl-other", "chat", "anonymous", "another-model", bodies[2]))
    journal.write(JournalEntry("chatcmpl-refused", "chat", "anonymous", first.model_name, bodies[2], [10**9]))

    second = SamePort(create_app(str(model_dir), drain_journal=True, kv_cache_dir=str(cache), **CONFIG), first.port)
    try:
        second.start()
        engine = second.app[STATE].serving.engine
        retrieved = {i: await asyncio.to_thread(second.openai("k").chat.completions.retrieve, rid) for i, rid in ids.items()}
        reattached = await remote.retrieve(ids[0])
        ridden_text, ridden_ids, ridden_error = await asyncio.wait_for(riding, _WAIT_S)
        async with aiohttp.ClientSession() as http:
            references = {}
            for i in [*ids, 2]:  # the same requests, uninterrupted, on the second server
                async with http.post(f"{second.base_url}/chat/completions", json=bodies[i]) as resp:
                    references[i] = await resp.json()
        for i, completion in retrieved.items():
            reference = references[i]["choices"][0]
            choice = completion.choices[0]
            assert completion.id == ids[i] and choice.finish_reason == "length"
            assert choice.message.content == reference["message"]["content"]
            assert choice.model_extra["token_ids"] == reference["token_ids"] and len(reference["token_ids"]) == LONG
            if i:
                assert choice.message.content.startswith(content(by_index[i]))
            # NOTE: every replay starts in one step: its prompt's KV came from the persisted cache, not a sibling's
            assert completion.usage.prompt_tokens_details.cached_tokens >= 32, completion.usage
            assert completion.usage.completion_tokens == LONG, completion.usage
            assert completion.usage.prompt_tokens == references[i]["usage"]["prompt_tokens"], completion.usage
        assert reattached.request_id == ids[0] and reattached.text == references[0]["choices"][0]["message"]["content"]
        assert reattached.text.startswith(sdk_text) and reattached.choices[0].token_ids[: len(sdk_ids)] == sdk_ids
        assert ridden_error is None and ridden_text == references[2]["choices"][0]["message"]["content"], ridden_error
        assert ridden_ids == references[2]["choices"][0]["token_ids"] and len(ridden_ids) == LONG
        assert [e.request_id for e in journal.load()] == ["chatcmpl-other"]  # replayed entries leave the journal
        assert "journal: skipping torn.json" in caplog.text
        assert "journal: entry chatcmpl-other cannot be replayed here (model: journalled for 'another-model'" in caplog.text
        assert "journal: entry chatcmpl-refused cannot be replayed here (InvalidRequestError: resume_token_ids" in caplog.text
        await assert_quiescent(engine)
    finally:
        await remote.aclose()
        await auto.aclose()
        second.stop()


async def test_journalled_completions_wait_out_a_full_queue_and_answer_by_id(model_dir, tmp_path) -> None:
    """Completions journalled at 0, 5 and 11 tokens replay on a server whose admission queue takes one at a time
    (the refused ones try again) and answer at GET /v1/completions/{id} as the uninterrupted run."""
    from engine import SamplingParams

    prompt = list(range(400, 430))
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    reference = AsyncEngine(str(model_dir), **ENGINE_CONFIG)
    try:
        deltas = [d async for d in reference.stream(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))]
    finally:
        await reference.shutdown()
    journal = RequestJournal(tmp_path / "kv" / "journal")
    cuts = {f"cmpl-cut{k}": k for k in (0, 1, 2, 3, 5, 11)}
    for request_id, k in cuts.items():  # what a caller had after its first k deltas
        got = deltas[:k]
        text, token_ids = "".join(d.text for d in got), [t for d in got for t in d.token_ids]
        journal.write(JournalEntry(request_id, "completion", "anonymous", model_dir.name, body, token_ids, text))
    config = dict(ENGINE_CONFIG, max_queued_requests=1)
    server = LiveServer(create_app(str(model_dir), drain_journal=True, kv_cache_dir=str(tmp_path / "kv"), **config))
    try:
        server.start()
        assert server.model_name == model_dir.name
        async with aiohttp.ClientSession() as http:
            for request_id in cuts:
                async with http.get(f"{server.base_url}/completions/{request_id}") as resp:
                    assert resp.status == 200, await resp.text()
                    result = await resp.json()
                choice = result["choices"][0]
                assert result["id"] == request_id and result["object"] == "text_completion"
                assert choice["token_ids"] == [t for d in deltas for t in d.token_ids]
                assert choice["text"] == "".join(d.text for d in deltas) and choice["finish_reason"] == "length"
            async with http.get(f"{server.base_url}/completions/cmpl-unknown") as resp:
                assert resp.status == 404 and (await resp.json())["error"]["param"] == "completion_id"
        engine = server.app[STATE].serving.engine
        assert journal.load() == [] and engine.stats()["requests_rejected"] > 0  # the queue did refuse some
        await assert_quiescent(engine)
    finally:
        server.stop()


async def test_a_continuation_goes_on_where_its_caller_stopped(model_dir) -> None:
    """``resume_token_ids`` continues a greedy or seeded run: the deltas carry only the rest, joined they equal the
    whole run."""
    from engine import SamplingParams

    engine = AsyncEngine(str(model_dir), **ENGINE_CONFIG)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    prompt = list(range(300, 312))
    try:
        for sampling in (params, seeded):
            whole = [t async for d in engine.stream(prompt, sampling) for t in d.token_ids]
            rest = [t async for d in engine.stream(prompt, sampling, resume_token_ids=whole[:8]) for t in d.token_ids]
            assert whole[:8] + rest == whole
        with pytest.raises(ParameterError) as bad:
            async for _ in engine.stream(prompt, params, resume_token_ids=[10**9]):
                pass
        assert bad.value.param == "resume_token_ids"
        await assert_quiescent(engine)
    finally:
        await engine.shutdown()


def test_a_journal_entry_names_the_field_it_lacks(tmp_path: Path) -> None:
    """An entry round-trips; a damaged one is refused naming the field, and the journal drops its file."""
    journal = RequestJournal(tmp_path)
    entry = JournalEntry("chatcmpl-1", "chat", "t", "m", {"messages": []}, [1, 2], "ab")
    journal.write(entry)
    assert journal.load() == [entry]
    with pytest.raises(ValueError, match="^token_ids"):
        JournalEntry.from_json(entry.to_json().replace("[1, 2]", '["x"]'))
    (tmp_path / "chatcmpl-1.json").write_text(entry.to_json().replace('"chat"', '"embeddings"'))
    assert journal.load() == [] and not list(tmp_path.iterdir())


def test_drain_journal_needs_kv_cache_dir() -> None:
    """Without kv_cache_dir the journal has nowhere to live: a typed error naming the setting."""
    with pytest.raises(ParameterError) as error:
        create_app(drain_journal=True)
    assert error.value.param == "drain_journal"
