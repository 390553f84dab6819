"""The Responses API over HTTP on the real engine (tiny random-weight model): bad input, tenants, the stream's
events, conversations on the prefix cache, the store's bounds, leaks, and the vLLM routes beside it."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from integrations.openai_server.app import create_app
from integrations.openai_server.policy import ServerPolicy, Tenant, key_id
from integrations.openai_server.responses_api import RESPONDER
from integrations.openai_server.state import STATE
from sdk import AsyncClient
from sdk.errors import InvalidRequestError, NotFoundError
from sdk.responses import ResponsesConfig
from tests.integrations.conftest import LiveServer
from tests.support.quiescence import assert_quiescent

BLOCK_SIZE = 16
ENGINE = dict(num_blocks=256, block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024)
POLICY = ServerPolicy(tenants=(Tenant("a", ("sk-a",)), Tenant("b", ("sk-b",))))
SHORT = {"max_output_tokens": 8, "temperature": 0.0}
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Current weather of a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                   "additionalProperties": False},
}  # fmt: skip
CALL_ONCE = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 60}


@pytest.fixture(scope="module")
def server(tiny_model_factory) -> Any:
    live = LiveServer(create_app(str(tiny_model_factory("llama")), policy=POLICY, **ENGINE)).start()
    yield live
    live.stop()


async def _post(server: LiveServer, body: dict[str, Any], key: str = "sk-a") -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(server.base_url + "/responses", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.json()


async def _call(server: LiveServer, method: str, path: str, key: str = "sk-a") -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, server.root + path, headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.json()


def _error(status: int, body: dict[str, Any], expected_status: int, param: str) -> str:
    assert status == expected_status, body
    assert body["error"]["param"] == param, body
    return body["error"]["message"]


BAD_SCHEMA = {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": [{"type": "nonsense"}]}, 400, "input.0.type"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "4"}]}, 400, "input.0.call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400, "input.0.content.0.type"),
        ({"input": "hi", "text": {"format": BAD_SCHEMA}}, 400, "text.format.schema"),
        ({"input": "hi", "text": {"format": BAD_SCHEMA}, "tools": [WEATHER]}, 400, "text.format.schema"),
        ({"input": "hi", "text": {"format": {"type": "grammar"}}}, 400, "text.format.type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
        ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
        ({"input": "hi", "background": True}, 400, "background"),
        ({"input": "hi", "include": ["file_search_call.results"]}, 400, "include.0"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "hi", "truncation": "sideways"}, 400, "truncation"),
        ({"input": []}, 400, "input"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"input": "hi", "model": "another-model"}, 404, "model"),
    ],
)
async def test_bad_input_is_a_typed_error_naming_the_field(server, body, status, param) -> None:
    _error(*await _post(server, {**SHORT, **body}), status, param)


async def test_a_conversation_sends_only_new_items_and_reads_its_history_from_the_cache(server) -> None:
    """Three turns, each sending only its new items; each turn's usage has the turns before it cached."""
    status, first = await _post(server, {"input": "What is the weather in Paris?", "instructions": "Be brief.", **CALL_ONCE})
    assert status == 200 and first["status"] == "completed"
    call = next(item for item in first["output"] if item["type"] == "function_call")
    assert call["call_id"].startswith("call_") and json.loads(call["arguments"])["city"]
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 21 degrees."}
    status, second = await _post(server, {"input": [answer], "previous_response_id": first["id"], "instructions": "Be brief.",
                                          "tools": [WEATHER], "tool_choice": "none", **SHORT})  # fmt: skip
    assert status == 200 and second["previous_response_id"] == first["id"]
    status, third = await _post(server, {"input": "Thanks!", "previous_response_id": second["id"], "instructions": "Be brief.",
                                         "tools": [WEATHER], "tool_choice": "none", **SHORT})  # fmt: skip
    assert status == 200
    for before, after in ((first, second), (second, third)):
        history = before["usage"]["input_tokens"] + before["usage"]["output_tokens"]
        # NOTE: whole blocks are cached; the reply's last tokens may re-render differently from how they were sampled
        assert after["usage"]["input_tokens_details"]["cached_tokens"] >= history - 2 * BLOCK_SIZE, (before["usage"], after["usage"])
    status, page = await _call(server, "GET", f"/v1/responses/{third['id']}/input_items?order=asc&limit=100")
    assert status == 200 and [item["type"] for item in page["data"]] == [
        "message", "function_call", "function_call_output", "message", "message"
    ]  # fmt: skip
    status, page = await _call(server, "GET", f"/v1/responses/{third['id']}/input_items?limit=2")
    assert page["has_more"] and page["data"][0]["content"] == "Thanks!" and page["last_id"] == page["data"][1]["id"]
    status, later = await _call(server, "GET", f"/v1/responses/{third['id']}/input_items?limit=2&after={page['last_id']}")
    assert [item["type"] for item in later["data"]] == ["function_call_output", "function_call"]


async def test_a_conversation_past_the_context_is_refused_or_truncated(server) -> None:
    """Past max_model_len: ``truncation: disabled`` is a 400 naming the input; ``auto`` drops the oldest items until it fits."""
    items = [{"role": "user", "content": f"Note {n}: " + "the quick brown fox jumps over the lazy dog " * 12} for n in range(12)]
    _error(*await _post(server, {"input": items, **SHORT}), 400, "input")
    status, fitted = await _post(server, {"input": items, "truncation": "auto", **SHORT})
    assert status == 200 and fitted["truncation"] == "auto" and fitted["usage"]["input_tokens"] <= 1024 - SHORT["max_output_tokens"]
    status, page = await _call(server, "GET", f"/v1/responses/{fitted['id']}/input_items?order=asc&limit=100")
    assert 0 < len(page["data"]) < len(items) and page["data"][-1]["content"] == items[-1]["content"]


async def test_another_tenants_response_is_not_found(server) -> None:
    """Tenant b can neither read, list, continue nor delete a's response: the same 404 as an unknown id."""
    status, mine = await _post(server, {"input": "Hello", **SHORT})
    rid = mine["id"]
    for method, path in (("GET", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}/input_items"), ("DELETE", f"/v1/responses/{rid}")):
        _error(*await _call(server, method, path, key="sk-b"), 404, "response_id")
        assert (await _call(server, method, path.replace(rid, "resp_unknown")))[0] == 404
    _error(*await _post(server, {"input": "Go on", "previous_response_id": rid, **SHORT}, key="sk-b"), 404, "previous_response_id")
    status, again = await _call(server, "GET", f"/v1/responses/{rid}")
    assert status == 200 and again == mine


async def test_a_deleted_response_is_gone_with_its_pin(server) -> None:
    responder = server.app[RESPONDER]
    status, made = await _post(server, {"input": "Hello", **SHORT})
    key = ("a", made["id"])
    server.call(responder.pins.ready(key))
    assert key in responder.pins
    status, deleted = await _call(server, "DELETE", f"/v1/responses/{made['id']}")
    assert status == 200 and deleted == {"id": made["id"], "object": "response.deleted", "deleted": True}
    assert key not in responder.pins and responder.pins.released["deleted"] >= 1
    _error(*await _call(server, "GET", f"/v1/responses/{made['id']}"), 404, "response_id")
    _error(*await _call(server, "DELETE", f"/v1/responses/{made['id']}"), 404, "response_id")
    _error(*await _post(server, {"input": "Go on", "previous_response_id": made["id"], **SHORT}), 404, "previous_response_id")


async def test_the_stream_is_openais_events_in_order(server) -> None:
    """Named events, sequence numbers from 0, one item's events together; the last is the stored response."""
    body = {"input": "Hello", "stream": True, "max_output_tokens": 12, "temperature": 0.0}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.base_url + "/responses", json=body, headers={"Authorization": "Bearer sk-a"}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            lines = [line.decode().rstrip("\n") async for line in resp.content if line.strip()]
    names, events = lines[0::2], [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [name.removeprefix("event: ") for name in names] == [event["type"] for event in events]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    kinds = [event["type"].removeprefix("response.") for event in events]
    assert kinds[:4] == ["created", "in_progress", "output_item.added", "content_part.added"]
    assert kinds[-4:] == ["output_text.done", "content_part.done", "output_item.done", "incomplete"]  # 12 tokens cut it
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert (await _call(server, "GET", f"/v1/responses/{final['id']}"))[1] == final


async def test_the_sdk_responds_over_http_and_in_process(server, tiny_model_factory) -> None:
    """``AsyncClient.respond`` against the server (which keeps the conversation) and in process (the client keeps it)."""
    remote = AsyncClient(base_url=server.base_url, api_key="sk-a")
    local = AsyncClient(str(tiny_model_factory("llama")), **ENGINE)
    try:
        for client in (remote, local):
            first = await client.respond("Hello", instructions="Be brief.", **SHORT)
            assert first.status == "incomplete" and first.output_text and first.usage.input_tokens > 0
            second = await client.respond("Again", previous_response_id=first.id, instructions="Be brief.", **SHORT)
            assert second.usage.input_tokens_details.cached_tokens >= BLOCK_SIZE
            kinds = [event.type async for event in await client.respond("Hi", stream=True, **SHORT)]
            assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
            with pytest.raises(NotFoundError) as info:
                await client.respond("Go on", previous_response_id="resp_unknown", **SHORT)
            assert info.value.param == "previous_response_id"
            with pytest.raises(InvalidRequestError) as bad:
                await client.respond([{"type": "function_call_output", "call_id": "call_x", "output": "4"}], **SHORT)
            assert bad.value.param == "input.0.call_id"
    finally:
        await remote.aclose()
        await local.aclose()


async def test_tokenize_detokenize_and_version(server) -> None:
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-a"}) as http:
        async with http.post(server.root + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}) as resp:
            tokens = await resp.json()
        assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] == 1024
        async with http.post(server.root + "/detokenize", json={"tokens": tokens["tokens"]}) as resp:
            assert (await resp.json())["prompt"] == "Hello world"
        chat = {"messages": [{"role": "user", "content": "Hello world"}]}
        async with http.post(server.root + "/tokenize", json=chat) as resp:
            rendered = await resp.json()
        assert rendered["count"] > tokens["count"] and rendered["token_strs"] is None
        async with http.post(server.root + "/detokenize", json={"tokens": [10**9]}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "tokens.0"
        async with http.post(server.root + "/tokenize", json={"prompt": "a", **chat}) as resp:
            assert resp.status == 400
        async with http.get(server.root + "/version") as resp:
            assert resp.status == 200 and (await resp.json())["version"]


async def test_nothing_is_left_pinned_or_held(server) -> None:
    """Pins past their time are released (a clock moved on); then the engine holds no pin, block or request."""
    responder = server.app[RESPONDER]
    await _post(server, {"input": "One more", **SHORT})
    assert responder.pins.num_pins >= 1

    async def expire() -> None:
        responder.pins._clock = lambda: float("inf")  # NOTE: every pin is past its time
        responder.sweep()

    server.call(expire())
    assert responder.pins.num_pins == 0 and responder.pins.released["ttl"] >= 1
    async with aiohttp.ClientSession() as http:
        async with http.get(server.root + "/metrics", headers={"Authorization": "Bearer sk-a"}) as resp:
            metrics = await resp.text()
    assert "paged_conversation_pins 0.0" in metrics and 'paged_conversation_pins_released_total{reason="ttl"}' in metrics
    server.call(assert_quiescent(server.app[STATE].serving, timeout=10.0))


async def test_pins_leave_room_for_the_longest_request(tiny_model_factory) -> None:
    """Conversations pinned over as much of a small KV cache as pins may hold; a request of max_model_len still runs
    to its end alone (the engine cuts short a lone request that the cache cannot hold)."""
    config = ResponsesConfig(pin_max_fraction=1.0)
    app = create_app(str(tiny_model_factory("llama")), api_key="sk-a", responses=config,
                     **{**ENGINE, "num_blocks": 32, "max_model_len": 256})  # fmt: skip
    live = LiveServer(app).start()
    responder = app[RESPONDER]
    try:
        for n in range(4):
            status, made = await _post(live, {"input": f"Conversation {n}: " + "lorem ipsum dolor sit amet " * 8, **SHORT})
            live.call(responder.pins.ready((key_id("sk-a"), made["id"])))
        assert responder.pins.released["budget"] >= 1 and responder.pins.num_tokens <= 32 * 16 - 256
        status, long = await _post(live, {"input": "Read this: " + "consectetur adipiscing elit " * 21, "store": False, **SHORT})
        assert status == 200 and long["usage"]["input_tokens"] > 200 and long["usage"]["output_tokens"] == SHORT["max_output_tokens"]
    finally:
        live.stop()


async def test_the_store_keeps_to_its_bound_and_outlives_a_restart(tiny_model_factory, tmp_path) -> None:
    """Past the byte bound the oldest responses are dropped (404); with kv_cache_dir a new server reads the rest back."""
    config = ResponsesConfig(store_max_bytes=6000)
    app = create_app(str(tiny_model_factory("llama")), api_key="sk-a", responses=config, kv_cache_dir=str(tmp_path), **ENGINE)
    first = LiveServer(app).start()
    try:
        ids = [(await _post(first, {"input": f"Message {n}", **SHORT}))[1]["id"] for n in range(8)]
        store = app[RESPONDER].store
        assert store.num_bytes <= 6000 and store.dropped["size"] > 0 and len(store) < len(ids)
        kept = [rid for rid in ids if store.get(key_id("sk-a"), rid) is not None]
        assert kept == ids[-len(kept):]
        _error(*await _call(first, "GET", f"/v1/responses/{ids[0]}"), 404, "response_id")
        kept_body = (await _call(first, "GET", f"/v1/responses/{kept[-1]}"))[1]
    finally:
        first.stop()
    second = LiveServer(create_app(str(tiny_model_factory("llama")), api_key="sk-a", responses=config,
                                   kv_cache_dir=str(tmp_path), **ENGINE)).start()  # fmt: skip
    try:
        assert (await _call(second, "GET", f"/v1/responses/{kept[-1]}")) == (200, kept_body)
        status, more = await _post(second, {"input": "Go on", "previous_response_id": kept[-1], **SHORT})
        assert status == 200 and more["usage"]["input_tokens_details"]["cached_tokens"] >= BLOCK_SIZE  # the persisted pin's blocks
    finally:
        second.stop()

