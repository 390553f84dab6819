"""The server's side of the fleet's relay, on the tiny llama without Ray: marked events, continuations, who may ask.

The test holds the ``FleetRelay`` an ``EngineReplica`` would put on the app, so it sends what the
replica sends for the ingress: the relay's secret, and a continuation offered in process.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from integrations.openai_server.app import create_app
from integrations.openai_server.relay import RELAY, CONTINUE_HEADER, RELAY_HEADER, Continuation, FleetRelay, read_marker
from integrations.openai_server.state import STATE

ENGINE = {"num_blocks": 256, "block_size": 16, "max_num_seqs": 8, "max_model_len": 512}
CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24, "ignore_eos": True}
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
ROUTES = {"chat": ("/v1/chat/completions", CHAT), "completion": ("/v1/completions", COMPLETION)}


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture
def relayed(live_server, model_dir):
    """A server with a relay, and the relay."""
    app = create_app(model_dir, **ENGINE)
    relay = app[RELAY] = FleetRelay()
    return live_server(app), relay


def _post(server, path: str, body: dict[str, Any], headers: Any = ()) -> tuple[int, bytes]:
    with httpx.Client(timeout=60) as client:
        response = client.post(f"{server.root}{path}", json={**body, "stream": True}, headers=list(headers))
        return response.status_code, response.content


def _split(raw: bytes) -> list[tuple[Any, Any]]:
    """Each event as (its marker or None, its data: parsed JSON, or "[DONE]")."""
    out = []
    for event in raw.split(b"\n\n")[:-1]:
        mark, event = read_marker(event)
        data = event.removeprefix(b"data: ")
        out.append((mark, "[DONE]" if data == b"[DONE]" else json.loads(data)))
    return out


def _comparable(data: Any) -> Any:
    """An event without what differs between two engines' runs: the latency breakdown and cache hits."""
    if isinstance(data, dict) and data.get("usage"):
        data = {**data, "usage": {k: v for k, v in data["usage"].items() if k in ("prompt_tokens", "completion_tokens")}}
    return data


@pytest.mark.parametrize("route", ["chat", "completion"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_a_continuation_sends_exactly_the_events_the_cut_stream_had_left(relayed, route, sampling):
    """Cut after 5 tokens, continued from them: the same id, the rest of the events, usage of the whole run."""
    server, relay = relayed
    path, body = ROUTES[route]
    body = {**body, **sampling, "stream_options": {"include_usage": True}}
    status, raw = _post(server, path, body, relay.headers())
    assert status == 200
    whole = _split(raw)
    marks = [m for m, _ in whole if m is not None]
    assert marks and all(m.request_id == whole[0][1]["id"] for m in marks) and marks[-1].final
    token_ids = [t for m in marks for t in m.token_ids]
    assert len(token_ids) == 24

    cut = next(i for i, _ in enumerate(whole) if sum(len(m.token_ids) for m, _ in whole[: i + 1] if m) == 5) + 1
    continuation = Continuation(marks[0].request_id, marks[0].created, tuple(token_ids[:5]))
    status, raw = _post(server, path, body, relay.headers(continuation))
    assert status == 200
    rest = _split(raw)
    assert [_comparable(d) for _, d in rest] == [_comparable(d) for _, d in whole[cut:]]
    assert rest[-2][1]["usage"]["completion_tokens"] == 24
    assert [t for m, _ in rest if m for t in m.token_ids] == token_ids[5:]
    assert server.app[STATE].metrics.requests_continued._value.get() == 1


def test_only_the_relay_gets_markers_and_continuations(relayed):
    """Without the secret: no markers, a continuation header ignored; an unknown key, or n > 1 continued, is a 400."""
    server, relay = relayed
    path, body = ROUTES["chat"]
    status, raw = _post(server, path, body, [(RELAY_HEADER, "guess"), (CONTINUE_HEADER, "guess")])
    assert status == 200 and b"paged-relay" not in raw and len(_split(raw)) == 1 + 24 + 1  # opening, tokens, [DONE]
    assert _post(server, path, body, [(RELAY_HEADER, relay.secret), (CONTINUE_HEADER, "guess")])[0] == 400
    status, raw = _post(server, path, {**body, "n": 2}, relay.headers())
    assert status == 200 and b"paged-relay" not in raw  # two completions: not continuable, not marked
    continuation = Continuation("chatcmpl-x", 1, (1, 2))
    status, raw = _post(server, path, {**body, "n": 2}, relay.headers(continuation))
    assert status == 400 and b"continuation" in raw


def test_a_chat_whose_reasoning_is_parsed_here_is_not_marked(live_server, model_dir):
    """A thinking model's chat reply is split here as it streams; a continuation would split it afresh: not continuable."""
    app = create_app(model_dir, reasoning_parser="qwen3", **ENGINE)
    relay = app[RELAY] = FleetRelay()
    server = live_server(app)
    for route, marked in (("chat", False), ("completion", True)):
        path, body = ROUTES[route]
        status, raw = _post(server, path, body, relay.headers())
        assert status == 200 and (b"paged-relay" in raw) == marked, route
