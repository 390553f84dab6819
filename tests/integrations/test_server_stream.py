"""Streaming, n, logprobs, hooks, disconnects and draining, over a scripted engine (exact and fast)."""

from __future__ import annotations

import http.client
import json
import threading
import time

import openai
import pytest

from integrations.openai_server.app import create_app
from integrations.openai_server.state import key_id
from integrations.openai_server.serving import Serving
from sdk.hooks import AuditLog, Hook, RegexFilter
from tests.integrations.fake_engine import FakeEngine

KEY = "sk-stream-key"


@pytest.fixture
def make_server(live_server, tokenizer):
    def make(hooks=(), drain_timeout: float = 30.0, **engine_kwargs):
        engine = FakeEngine(tokenizer, **engine_kwargs)
        app = create_app(
            api_key=KEY, hooks=hooks, drain_timeout=drain_timeout, serving_factory=lambda: Serving(engine, hooks=hooks)
        )
        return live_server(app), engine

    return make


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=10)


def _sse(server, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", path, json.dumps(body), {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    return conn, conn.getresponse()


def _events(resp: http.client.HTTPResponse) -> list:
    events = []
    for raw in resp:
        line = raw.strip()
        if line.startswith(b"data: "):
            data = line[6:]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def _wait(predicate, timeout: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_chat_stream_wire_format(make_server):
    """SSE: a role chunk, content chunks, a finish chunk, the usage chunk (include_usage), then data: [DONE]."""
    server, _ = make_server()
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    conn, resp = _sse(server, "/v1/chat/completions", body)
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    events = _events(resp)
    conn.close()
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    assert text == " ok ok ok"
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert len({e["id"] for e in events[:-1]}) == 1


def test_n_choices_and_logprobs(make_server):
    """n=2 gives two indexed choices with summed usage; logprobs carry the sampled token and top candidates."""
    server, _ = make_server()
    client = _client(server)
    out = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2, logprobs=True, top_logprobs=2
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 4
    content = out.choices[1].logprobs.content
    assert [t.token for t in content] == [" ok", " ok"] and content[0].logprob == -0.5
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [(" ok", -0.5), ("<x>", -1.5)]
    cmpl = client.completions.create(model="fake-model", prompt=["a", "b"], max_tokens=2, logprobs=1)
    assert [c.index for c in cmpl.choices] == [0, 1] and cmpl.usage.completion_tokens == 4
    assert cmpl.choices[0].logprobs.tokens == [" ok", " ok"]
    assert cmpl.choices[0].logprobs.text_offset == [0, 3]
    assert cmpl.choices[0].logprobs.top_logprobs == [{" ok": -0.5}, {" ok": -0.5}]


def test_logprob_choices_reach_hooks_exactly_once(make_server):
    """n=2 with logprobs is one SDK request (the engine makes the choices): on_request and on_finish run once, asking for top-2 logprobs."""

    class Count(Hook):
        def __init__(self) -> None:
            self.started: list[tuple[str, int | None]] = []
            self.finished: list[str] = []

        async def on_request(self, ctx) -> None:
            self.started.append((ctx.request_id, ctx.params.get("logprobs")))

        async def on_finish(self, ctx) -> None:
            self.finished.append(ctx.request_id)

    hook = Count()
    server, engine = make_server(hooks=[hook])
    messages = [{"role": "user", "content": "hi"}]
    out = _client(server).chat.completions.create(
        model="fake-model", messages=messages, max_tokens=2, n=2, logprobs=True, top_logprobs=2
    )
    assert [len(c.logprobs.content) for c in out.choices] == [2, 2]
    assert [k for _, k in hook.started] == [2]
    assert hook.finished == [r for r, _ in hook.started]
    assert engine.num_finished == 1


def test_hooks_see_every_request_with_tenant_id(make_server, tmp_path):
    """Input filters block with a 400 content_filter; the audit log has one record per request, tenant = key id."""
    audit = tmp_path / "audit.jsonl"
    server, engine = make_server(hooks=[RegexFilter(r"secret"), AuditLog(audit)])
    client = _client(server)
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "a secret"}])
    assert err.value.body["code"] == "content_filter"
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [r["route"] for r in records] == ["http", "http"]
    assert {r["tenant"] for r in records} == {key_id(KEY)}
    assert KEY not in audit.read_text()
    assert AuditLog.verify(audit) == 2
    assert engine.num_finished == 1  # the blocked request never reached the engine


def test_output_filter_stops_stream_with_content_filter(make_server):
    """An output filter ends the stream mid-way with finish_reason content_filter and aborts the engine request."""
    server, engine = make_server(hooks=[RegexFilter(r"ok ok", on="output")], delay=0.01)
    stream = _client(server).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=50, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "content_filter"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " ok"
    assert _wait(lambda: not engine.running)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_request(make_server, stream):
    """A client that goes away (after the first chunk, or while waiting) leaves nothing running within a second."""
    server, engine = make_server(delay=0.05)
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 200, "stream": stream}
    conn, resp = _sse(server, "/v1/completions", body) if stream else (None, None)
    if stream:
        assert resp.readline().startswith(b"data: ")
        conn.sock.close()
        conn.close()
    else:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
        assert _wait(lambda: len(engine.running) == 1)
        conn.sock.close()
        conn.close()
    assert _wait(lambda: not engine.running), engine.running
    assert engine.num_finished == 1


def test_shutdown_drains_then_aborts_with_terminal_answers(make_server):
    """On shutdown: /health turns 503, new requests get 503, in-flight ones past the drain timeout end with an answer."""
    server, engine = make_server(delay=0.05, drain_timeout=0.5)
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 400}
    results: dict = {}

    def streaming() -> None:
        conn, resp = _sse(server, "/v1/completions", {**body, "stream": True})
        results["stream"] = _events(resp)

    def blocking() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        results["blocking"] = (resp.status, json.loads(resp.read()))

    threads = [threading.Thread(target=streaming), threading.Thread(target=blocking)]
    for t in threads:
        t.start()
    assert _wait(lambda: len(engine.running) == 2, 5)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    for t in threads:
        t.join(10)
    stopper.join(10)
    status, error = results["blocking"]
    assert status == 503 and error["error"]["code"] == "shutdown"
    events = results["stream"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutdown"
    assert not engine.running and engine.is_running is False


def test_streamed_completion_logprobs_offsets_continue(make_server):
    """Streamed completion logprobs carry text offsets that continue across chunks."""
    server, _ = make_server()
    stream = _client(server).completions.create(model="fake-model", prompt="hi", max_tokens=3, logprobs=0, stream=True)
    offsets = [o for chunk in stream for c in chunk.choices if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == [0, 3, 6]


def test_failed_admission_of_one_choice_closes_all(make_server):
    """When choices cannot all start (overload), the request is 429 and no sibling is left running."""
    server, engine = make_server(overloaded=True)
    with pytest.raises(openai.RateLimitError):
        _client(server).completions.create(model="fake-model", prompt=["a", "b"], n=2, max_tokens=3)
    assert not engine.running


def test_drain_journal_keeps_what_the_caller_got_and_names_the_id(live_server, tokenizer, tmp_path):
    """With drain_journal, requests past the drain are journalled with what their caller got (503 request_journalled
    naming the id); one the journal cannot continue (n > 1) ends with shutdown as before."""
    from integrations.openai_server.journal import RequestJournal

    engine = FakeEngine(tokenizer, delay=0.05)
    app = create_app(
        api_key=KEY, drain_timeout=0.5, drain_journal=True, kv_cache_dir=str(tmp_path),
        serving_factory=lambda: Serving(engine),
    )  # fmt: skip
    server = live_server(app)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}
    results: dict = {}

    def streaming() -> None:
        conn, resp = _sse(server, "/v1/chat/completions", {**body, "stream": True})
        results["stream"] = _events(resp)

    def blocking(name: str, extra: dict) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, **extra}), {"Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        results[name] = (resp.status, json.loads(resp.read()))

    threads = [
        threading.Thread(target=streaming), threading.Thread(target=blocking, args=("blocking", {})),
        threading.Thread(target=blocking, args=("two", {"n": 2})),
    ]  # fmt: skip
    for t in threads:
        t.start()
    assert _wait(lambda: len(engine.running) == 3, 5)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    for t in threads:
        t.join(10)
    stopper.join(10)
    events = results["stream"]
    error = events[-2]["error"]
    assert events[-1] == "[DONE]" and error["code"] == "request_journalled" and error["request_id"] == events[0]["id"]
    status, blocked = results["blocking"]
    assert status == 503 and blocked["error"]["code"] == "request_journalled"
    assert results["two"][0] == 503 and results["two"][1]["error"]["code"] == "shutdown"
    entries = {e.request_id: e for e in RequestJournal(tmp_path / "journal").load()}
    assert set(entries) == {error["request_id"], blocked["error"]["request_id"]}
    streamed = entries[error["request_id"]]
    sent = "".join(c["delta"].get("content") or "" for e in events[:-2] for c in e["choices"])
    assert streamed.text == sent and streamed.token_ids == [engine.token_id] * sent.count(" ok") and sent
    assert streamed.route == "chat" and streamed.tenant == key_id(KEY) and streamed.body["max_tokens"] == 400
    held = entries[blocked["error"]["request_id"]]
    assert held.token_ids and held.text == " ok" * len(held.token_ids)  # not streamed: everything generated so far
