"""Error paths of the HTTP server over a scripted engine: status codes, OpenAI error bodies, clients' exception classes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from integrations.openai_server.app import create_app
from integrations.openai_server.serving import Serving
from engine.knobs import knobs_of
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams
from sdk.wire import WIRE_NAMES
from tests.integrations.fake_engine import FakeEngine
from tests.support.knob_cases import knob_cases

KEY = "sk-test-key"


@pytest.fixture
def make_server(live_server, tokenizer):
    """``make_server(**engine_kwargs, **app_kwargs)`` -> (LiveServer, FakeEngine)."""

    def make(api_key: str | None = KEY, client_max_size: int = 1 << 20, **engine_kwargs):
        engine = FakeEngine(tokenizer, **engine_kwargs)
        app = create_app(api_key=api_key, client_max_size=client_max_size, serving_factory=lambda: Serving(engine))
        return live_server(app), engine

    return make


def _client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=10)


def _raw(server, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, dict]:
    request = urllib.request.Request(server.root + path, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def test_chat_roundtrip_through_fake_engine(make_server):
    """A chat completion returns the engine's text, finish reason and usage in the OpenAI shape."""
    server, _ = make_server()
    out = _client(server).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert out.choices[0].message.content == " ok ok ok"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 3 and out.usage.prompt_tokens > 0


def test_missing_or_wrong_key_is_401_except_health(make_server):
    """Every route but /health needs the key; a wrong one maps to the client's AuthenticationError."""
    server, _ = make_server()
    with pytest.raises(openai.AuthenticationError) as err:
        _client(server, key="sk-wrong").models.list()
    assert err.value.body["code"] == "invalid_api_key"
    for path in ("/v1/models", "/metrics"):
        status, _, body = _raw(server, path)
        assert status == 401 and body["error"]["type"] == "authentication_error"
    assert _raw(server, "/health")[0] == 200
    assert [m.id for m in _client(server).models.list().data] == ["fake-model"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 500.0), ("n", 0), ("top_p", 0.0), ("messages", []), ("max_tokens", 0), ("top_logprobs", 99)],
)
def test_invalid_parameters_are_400_naming_the_field(make_server, field, value):
    """Out-of-range knobs and empty messages are BadRequestError with ``param`` naming the field."""
    server, engine = make_server()
    kwargs = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    if field == "top_logprobs":
        kwargs["logprobs"] = True
    with pytest.raises(openai.BadRequestError) as err:
        _client(server).chat.completions.create(**kwargs)
    assert err.value.body["param"] == field
    assert err.value.body["type"] == "invalid_request_error"
    assert engine.num_finished == 0  # nothing reached the engine


def _first_refused(knob) -> object:
    return next(value for value, ok in knob_cases(knob) if not ok)


WIRE_CASES = [
    (route, WIRE_NAMES[route].get(k.name, k.name), _first_refused(k))
    for route in ("chat", "completion")
    for k in [*knobs_of(SamplingParams), *knobs_of(RequestOptions)]
    if k.name != "request_id"  # the server makes the ids
] + [("chat", "max_completion_tokens", 0), ("chat", "messages", [{"role": "user", "content": 3}]), ("completion", "prompt", 3)] + [
    # structured output: every spelling on both routes; the engine never sees these
    (route, field, value)
    for route in ("chat", "completion")
    for field, value in [
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {}, "nme": "typo"}}),
        ("response_format", {"type": "regex", "regex": "a"}),  # not one of OpenAI's types
        ("response_format", "json_object"),
        ("structured_outputs", {"regex": "a", "choice": ["b"]}),
        ("structured_outputs", {"regex": "a", "whitespace_pattern": " "}),
        ("structured_outputs", {"choice": []}),
        ("guided_json", "{not json"),
        ("guided_regex", 3),
        ("guided_choice", []),
        ("guided_grammar", ""),
    ]
]


@pytest.mark.parametrize(("route", "field", "value"), WIRE_CASES, ids=lambda v: str(v)[:16])
def test_every_validated_field_is_named_in_param(make_server, route, field, value):
    """Each field the server validates, refused over HTTP, is a 400 whose ``param`` names it; nothing reaches the engine."""
    server, engine = make_server()
    body = {"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"}
    body[field] = value
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, _, answer = _raw(server, path, json.dumps(body).encode(), headers)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"].split(".")[0] == field
    assert engine.num_finished == 0


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
USER = {"role": "user", "content": "hi"}
TOOL_CASES = [
    ({"messages": [USER, {"role": "tool", "content": "3"}]}, "messages.1.tool_call_id"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [CALL, {**CALL, "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.1.tool_calls.1.function.arguments"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [USER, {"role": "assistant", "content": None}]}, "messages.1.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]}, "messages.0.content.1"),
    ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"messages": [USER], "tools": [TOOL, {"type": "function"}]}, "tools"),
    ({"messages": [USER], "tools": [3]}, "tools.0"),
    ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [USER], "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": [USER], "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [USER], "tool_choice": "required"}, "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), TOOL_CASES, ids=lambda v: str(v)[-24:])
def test_tool_fields_and_turns_are_named_in_param(make_server, body, param):
    """Malformed tools, tool choices and tool turns are a 400 whose ``param`` is the exact path; nothing reaches the engine."""
    server, engine = make_server()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, _, answer = _raw(server, "/v1/chat/completions", json.dumps(body).encode(), headers)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param, answer
    assert engine.num_finished == 0


def test_engine_side_validation_is_400(make_server):
    """Knobs the wire schema lets through but the engine refuses (repetition_penalty=0) come back as 400 naming them."""
    server, _ = make_server()
    with pytest.raises(openai.BadRequestError) as err:
        _client(server).completions.create(model="fake-model", prompt="hi", extra_body={"repetition_penalty": 0.0})
    assert err.value.body["param"] == "repetition_penalty"


def test_overlong_prompt_is_400(make_server):
    """A prompt longer than max_model_len is rejected before it queues."""
    server, _ = make_server()
    with pytest.raises(openai.BadRequestError) as err:
        _client(server).completions.create(model="fake-model", prompt="word " * 400, max_tokens=4)
    assert "max_model_len" in err.value.body["message"]


def test_unknown_model_unsupported_field_and_bad_json(make_server):
    """Unknown model -> 404, echo -> 400 naming it, a body that is not JSON -> 400; all OpenAI error bodies."""
    server, _ = make_server()
    client = _client(server)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="fake-model", prompt="hi", echo=True)
    assert err.value.body["param"] == "echo"
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, _, body = _raw(server, "/v1/chat/completions", b"{not json", headers)
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, _, body = _raw(server, "/v1/nowhere", None, headers)
    assert status == 404 and body["error"]["code"] == "not_found"


def test_oversize_body_is_413(make_server):
    """A body past client_max_size gets 413 with an OpenAI error body."""
    server, engine = make_server(client_max_size=4096)
    body = json.dumps({"model": "fake-model", "prompt": "x" * 10_000}).encode()
    status, _, err = _raw(server, "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
    assert status == 413 and err["error"]["code"] == "request_too_large"
    assert engine.num_finished == 0


def test_overloaded_engine_is_429_with_retry_after(make_server):
    """Full admission limits map to RateLimitError with a Retry-After header."""
    server, _ = make_server(overloaded=True)
    with pytest.raises(openai.RateLimitError) as err:
        _client(server).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.response.headers["Retry-After"] == "1"


def test_engine_fault_is_500_without_traceback_and_ends_a_stream(make_server):
    """An engine fault answers 500 (no stack trace in the body); mid-stream it becomes an error event the client raises."""
    server, _ = make_server(fail_after=2)
    client = _client(server)
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="fake-model", prompt="hi", max_tokens=5)
    assert "Traceback" not in err.value.response.text
    stream = client.completions.create(model="fake-model", prompt="hi", max_tokens=5, stream=True)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass


def test_starting_server_is_503(live_server, tokenizer):
    """Until the engine is loaded, /health and the API answer 503 (phase "starting")."""
    import threading

    loaded = threading.Event()

    def slow_factory() -> Serving:
        loaded.wait(20)
        return Serving(FakeEngine(tokenizer))

    server = live_server(create_app(serving_factory=slow_factory), wait_healthy=False)
    try:
        status, headers, body = _raw(server, "/health")
        assert (status, body["status"]) == (503, "starting")
        with pytest.raises(openai.InternalServerError) as err:
            _client(server).models.list()
        assert err.value.status_code == 503
    finally:
        loaded.set()
    server.wait_phase("serving")
    assert _raw(server, "/health")[0] == 200


def test_dead_engine_turns_health_and_api_to_503(make_server):
    """When the engine stops running, /health answers 503 "dead" and requests get 503 instead of hanging."""
    server, engine = make_server()
    engine.is_running = False
    status, _, body = _raw(server, "/health")
    assert (status, body["status"]) == (503, "dead")
    with pytest.raises(openai.InternalServerError) as err:
        _client(server).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 503 and err.value.body["code"] == "server_dead"


def test_max_completion_tokens_wins_over_max_tokens(make_server):
    """max_completion_tokens (the newer name) bounds the reply; max_tokens is the fallback."""
    server, _ = make_server()
    client = _client(server)
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=5, max_completion_tokens=2)
    assert out.usage.completion_tokens == 2
    assert client.chat.completions.create(model="fake-model", messages=messages, max_tokens=4).usage.completion_tokens == 4
