"""Validation wherever input enters: random values of every type give a result or a typed error naming the field."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import time
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from engine import AsyncEngine, Engine, EngineConfig, RequestRejected, SamplingParams
from engine.request_options import RequestOptions
from tests.support.quiescence import assert_quiescent, check_engine_quiescent
from integrations.openai_server.app import create_app
from integrations.openai_server.serving import Serving
from sdk import AsyncClient
from sdk.errors import PagedError
from sdk.transport import InProcessTransport
from sdk.types import ChatMessage, ChatRequest, CompletionRequest
from tests.integrations.conftest import LiveServer

# Every run stays short: max_model_len bounds any request that passes validation.
CONFIG = dict(num_blocks=64, block_size=8, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=64)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
ANY = st.one_of(SCALARS, st.lists(SCALARS, max_size=4), st.dictionaries(st.text(max_size=4), SCALARS, max_size=2))
# values that often pass validation, so the properties also reach the engine and the response paths
PLAUSIBLE = st.one_of(
    st.integers(min_value=0, max_value=6), st.floats(min_value=0, max_value=1.5), st.booleans(),
    st.lists(st.text(min_size=1, max_size=3), max_size=2),
)  # fmt: skip
VALUE = st.one_of(PLAUSIBLE, ANY)
# JSON values, NaN and Infinity included (Python's json reads them)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)

SAMPLING_FIELDS = [
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "n",
]  # fmt: skip
CONFIG_FIELDS = [
    "model", "dtype", "device", "block_size", "kv_cache_memory", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
    "max_model_len", "enable_prefix_caching", "attention_backend", "max_queued_requests", "max_queued_tokens", "seed",
]  # fmt: skip


def _names_a_field(error: Exception, fields: Any) -> bool:
    return any(f in str(error) for f in fields)


@FAST
@given(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), ANY, max_size=4))
def test_sampling_params_accepts_or_names_the_field(kwargs: dict[str, Any]) -> None:
    """SamplingParams of random values is valid and in range, or a ValueError naming a given field."""
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        assert _names_a_field(exc, kwargs), exc
    else:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            assert math.isfinite(getattr(params, name))
        assert 1 <= params.n <= 64
        assert params.max_tokens is None or 1 <= params.max_tokens <= 1 << 20
        assert all(isinstance(s, str) and s for s in params.stop)


@FAST
@given(st.dictionaries(st.sampled_from(CONFIG_FIELDS), ANY, max_size=3))
def test_engine_config_accepts_or_names_the_field(kwargs: dict[str, Any]) -> None:
    """EngineConfig of random values constructs or raises ValueError naming a given field; never another error."""
    try:
        EngineConfig(**kwargs)
    except ValueError as exc:
        assert _names_a_field(exc, kwargs), exc


def test_absurd_sizes_are_rejected_in_milliseconds_without_allocating(model_dir) -> None:
    """Huge n, max_tokens, logprobs, stop lists, stop strings, prompts and ids are refused fast, allocating < 64 KiB."""
    engine = Engine(str(model_dir), **CONFIG)
    huge_list, huge_str = ["x"] * 10**6, "x" * 10**7
    huge_ids = [1] * 10**7
    cases = [
        ("n", lambda: SamplingParams(n=10**9)),
        ("max_tokens", lambda: SamplingParams(max_tokens=10**18)),
        ("logprobs", lambda: SamplingParams(logprobs=10**6)),
        ("stop", lambda: SamplingParams(stop=huge_list)),
        ("stop", lambda: SamplingParams(stop=[huge_str])),
        ("stop_token_ids", lambda: SamplingParams(stop_token_ids=huge_ids)),
        ("temperature", lambda: SamplingParams(temperature=10**5000)),
        ("max_model_len", lambda: engine.processor.validate_prompt(huge_ids)),
        ("request_id", lambda: RequestOptions(huge_str, 0, None)),
        ("priority", lambda: RequestOptions("r", 10**5000, None)),
        ("cache_salt", lambda: RequestOptions("r", 0, huge_str)),
        ("max_num_seqs", lambda: EngineConfig(max_num_seqs=10**12)),
    ]
    for field, make in cases:
        tracemalloc.start()
        with pytest.raises(ValueError, match=field):
            make()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        elapsed = min(_timed(make) for _ in range(3))  # best of 3: a busy machine adds only delays
        assert elapsed < 0.005 and peak < 64 << 10, (field, elapsed, peak)


def _timed(make: Any) -> float:
    start = time.perf_counter()
    try:
        make()
    except ValueError:
        pass
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def sync_engine(model_dir) -> Engine:
    return Engine(str(model_dir), **CONFIG)


PROMPTS = st.one_of(
    st.lists(st.integers(min_value=-5, max_value=60000), max_size=80),
    st.lists(ANY, max_size=4),
    st.text(max_size=40),
    ANY,
)


@FAST
@given(prompt=PROMPTS, request_id=st.one_of(st.text(max_size=6), ANY), priority=ANY, cache_salt=ANY)
def test_engine_add_request_accepts_or_rejects_typed(sync_engine: Engine, prompt, request_id, priority, cache_salt) -> None:
    """Engine.add_request with random prompt, id, priority and salt queues or raises ValueError; the engine stays whole."""
    try:
        rid = sync_engine.add_request(request_id, prompt, SamplingParams(max_tokens=1), priority, cache_salt)
    except ValueError as exc:  # RequestRejected included
        assert isinstance(exc, RequestRejected) or _names_a_field(exc, ("request_id", "priority", "cache_salt")), exc
    else:
        sync_engine.step()
        sync_engine.abort_request(rid)
        sync_engine.step()
    check_engine_quiescent(sync_engine)


def test_unknown_roles_empty_messages_and_out_of_vocab_ids_are_typed(sync_engine: Engine) -> None:
    """An unknown role, no messages, an empty prompt and ids outside the vocabulary each raise a typed error."""
    with pytest.raises(ValidationError, match="role"):
        ChatMessage(role="wizard", content="x")
    with pytest.raises(ValidationError, match="messages"):
        ChatRequest(messages=[])
    with pytest.raises(RequestRejected, match="empty"):
        sync_engine.add_request(None, [])
    with pytest.raises(RequestRejected, match="vocabulary"):
        sync_engine.add_request(None, [sync_engine.vocab_size])
    with pytest.raises(RequestRejected, match="vocabulary"):
        sync_engine.add_request(None, [-1])
    check_engine_quiescent(sync_engine)


# --------------------------------------------------------------------------- SDK and HTTP, on a real engine


@pytest.fixture(scope="module")
def runner() -> Any:
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def async_engine(model_dir, runner) -> Any:
    engine = runner.run(_start(model_dir))
    yield engine
    runner.run(engine.shutdown())


async def _start(model_dir) -> AsyncEngine:
    return AsyncEngine(str(model_dir), **CONFIG)


SDK_FIELDS = [*SAMPLING_FIELDS[:-2], "request_id", "priority", "cache_salt", "timeout"]


@SLOW
@given(
    kind=st.sampled_from(["chat", "completion"]),
    content=st.one_of(
        st.text(max_size=30), st.text(max_size=30), st.lists(st.integers(min_value=-2, max_value=49200), max_size=8), ANY
    ),
    role=st.one_of(*[st.just(r) for r in ("system", "user", "assistant", "tool")], ANY),
    options=st.dictionaries(st.sampled_from(SDK_FIELDS), VALUE, max_size=3),
)
def test_sdk_requests_give_a_result_or_a_typed_error(async_engine, runner, kind, content, role, options) -> None:
    """Random SDK request fields: a pydantic ValidationError naming the field, a PagedError, or a result."""
    options = {"max_tokens": 4, **options}
    try:
        if kind == "chat":
            request: Any = ChatRequest(messages=[ChatMessage(role=role, content=content)], **options)
        else:
            request = CompletionRequest(prompt=content, **options)
    except ValidationError as exc:
        assert exc.errors()[0]["loc"], exc
        event("ValidationError")
        return
    client = AsyncClient(transport=InProcessTransport(async_engine))

    async def go() -> None:
        try:
            result = await (client.chat(request) if kind == "chat" else client.complete(request))
        except PagedError as exc:
            event(type(exc).__name__)
        else:
            event("result")
            assert result.finish_reason in ("stop", "length", "abort")
        await assert_quiescent(async_engine)

    runner.run(go())


@pytest.fixture(scope="module")
def server(async_engine) -> Any:
    app = create_app(serving_factory=lambda: Serving(async_engine, owns_engine=False))
    live = LiveServer(app).start()
    yield live
    live.stop()


BODY_FIELDS = [
    "model", "n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "stream",
    "stream_options", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "priority",
    "cache_salt", "return_token_ids", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "echo",
]  # fmt: skip
MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), JSON), "content": st.one_of(st.text(max_size=12), JSON)}
        ),
        min_size=1, max_size=2,
    ),
    JSON,
)


def _post(server: LiveServer, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@SLOW
@given(
    route=st.sampled_from(["chat", "completions"]),
    fields=st.dictionaries(st.sampled_from(BODY_FIELDS), st.one_of(PLAUSIBLE, JSON), max_size=4),
    messages=MESSAGES,
    prompt=st.one_of(st.text(max_size=20), st.lists(st.integers(min_value=-3, max_value=60000), max_size=12), JSON),
)
def test_http_bodies_get_a_result_or_a_4xx_never_a_500(server, async_engine, runner, route, fields, messages, prompt) -> None:
    """Random JSON bodies (NaN and Infinity included) get 200 or a 4xx with an OpenAI error body; never a 500."""
    body = {"max_tokens": 3, **fields}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    body["messages" if route == "chat" else "prompt"] = messages if route == "chat" else prompt
    if body.get("model") is not None and not isinstance(body["model"], str):
        body.pop("model")
    status, raw = _post(server, path, json.dumps(body).encode())
    event(f"HTTP {status}")
    assert status in (200, 400, 404, 429), (status, raw[:300])
    if status != 200:
        error = json.loads(raw)["error"]
        assert error["message"] and error["type"]
    runner.run(assert_quiescent(async_engine))


def test_http_garbage_and_oversized_bodies_are_4xx(server) -> None:
    """Non-JSON, a JSON array and a body past the size limit get 400 / 413 error bodies."""
    assert _post(server, "/v1/completions", b"\xff{not json")[0] == 400
    assert _post(server, "/v1/completions", b"[1, 2]")[0] == 400
    assert _post(server, "/v1/chat/completions", b'{"messages": [], "max_tokens": 2}')[0] == 400
    status, raw = _post(server, "/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
