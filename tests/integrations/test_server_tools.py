"""Tools over HTTP on the real engine (tiny random-weight model): the official client, LangChain, the SDK, the prefix cache.

The random weights follow no format by themselves: a call whose arguments validate was made to.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from integrations.openai_server.app import create_app
from integrations.openai_server.state import STATE

KEY = "sk-tools"
BLOCK_SIZE = 16
ENGINE_CONFIG = dict(num_blocks=256, block_size=BLOCK_SIZE, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]},
    },
}
BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "description": "Book a hotel room.",
        "parameters": {
            "type": "object",
            "properties": {
                "guest": {"type": "string", "maxLength": 8},
                "nights": {"type": "integer", "minimum": 1, "maximum": 9},
                "room": {"enum": ["single", "double"]},
            },
            "required": ["guest", "nights", "room"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Book a room in Paris for Ann."}]
CALLS = dict(tools=TOOLS, max_tokens=400, temperature=0.8)


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    """One server over a tiny llama for the module."""
    from tests.integrations.conftest import LiveServer

    live = LiveServer(create_app(str(tiny_model_factory("llama")), api_key=KEY, **ENGINE_CONFIG)).start()
    yield live
    live.stop()


def _valid(name: str, arguments: dict[str, Any]) -> bool:
    jsonschema.validate(arguments, SCHEMAS[name])
    return True


def test_required_gives_calls_valid_against_their_schemas(server):
    """tool_choice="required": replies are calls whose JSON arguments validate; one that ends by itself has null content."""
    client = server.openai(KEY)
    finish_reasons = []
    for seed in range(4):
        choice = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tool_choice="required", seed=seed, **CALLS).choices[0]
        # NOTE: parallel calls may go on until max_tokens (random weights); the call cut short is left out
        finish_reasons.append(choice.finish_reason)
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            assert _valid(call.function.name, json.loads(call.function.arguments))
    assert "tool_calls" in finish_reasons


def test_named_choice_and_no_parallel_calls(server):
    """A named tool_choice calls only that tool; parallel_tool_calls=False makes exactly one call."""
    client = server.openai(KEY)
    named = {"type": "function", "function": {"name": "book"}}
    for seed in range(2):
        out = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tool_choice=named, seed=seed, **CALLS)
        assert [c.function.name for c in out.choices[0].message.tool_calls] == ["book"]
        single = client.chat.completions.create(
            model=server.model_name, messages=MESSAGES, tool_choice="required", parallel_tool_calls=False, seed=seed, **CALLS
        )
        assert len(single.choices[0].message.tool_calls) == 1


def test_streamed_deltas_assemble_into_the_non_streamed_calls(server):
    """Streamed delta.tool_calls (id, type and name first, then argument fragments by index) join to the same calls."""
    client = server.openai(KEY)
    kwargs = dict(model=server.model_name, messages=MESSAGES, tool_choice="required", seed=3, **CALLS)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) > 1  # this seed's reply: several calls, then a stop
    calls: dict[int, dict[str, Any]] = {}
    finish_reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish_reasons.append(choice.finish_reason)
            assert choice.delta.content in (None, "")
            for d in choice.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.type is None and d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
    assert [f for f in finish_reasons if f is not None] == ["tool_calls"] and finish_reasons[-1] == "tool_calls"
    streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert streamed == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def test_a_conversation_with_tool_turns_sent_back(server):
    """The assistant's tool_calls message (as the client returned it) and the tool results go back; the model answers."""
    client = server.openai(KEY)
    messages: list[Any] = list(MESSAGES)
    first = client.chat.completions.create(model=server.model_name, messages=messages, tool_choice="required", seed=1, **CALLS)
    reply = first.choices[0].message
    messages.append(reply)
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "done"} for c in reply.tool_calls]
    second = client.chat.completions.create(model=server.model_name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens // 2


def test_langchain_chat_openai_bind_tools(server):
    """ChatOpenAI(base_url=...).bind_tools(...) gets AIMessage.tool_calls with arguments valid for the named tool."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=server.model_name, base_url=server.base_url, api_key=KEY, max_tokens=200, temperature=0.8, seed=3, max_retries=0)
    reply = chat.bind_tools(TOOLS, tool_choice="book").invoke("Book a room for Ann.")
    assert [c["name"] for c in reply.tool_calls] == ["book"] and _valid("book", reply.tool_calls[0]["args"])
    reply = chat.bind_tools(TOOLS, tool_choice="required").invoke("Book a room for Ann.")
    assert reply.tool_calls and all(_valid(c["name"], c["args"]) for c in reply.tool_calls)
    assert reply.response_metadata["finish_reason"] == "tool_calls"


async def test_sdk_over_http_gets_typed_calls_streaming_too(server):
    """sdk.AsyncClient(base_url=...) sends tools and reads typed ToolCalls back; its streamed deltas collect to them."""
    from sdk import AsyncClient
    from sdk.tools import ToolCall, collect_calls

    kwargs = dict(tool_choice={"type": "function", "function": {"name": "book"}}, seed=3, **CALLS)
    async with AsyncClient(base_url=server.base_url, api_key=KEY) as client:
        result = await client.chat("Book a room for Ann.", **kwargs)
        assert result.finish_reason == "tool_calls" and result.text == ""
        assert all(isinstance(c, ToolCall) and c.name == "book" and _valid(c.name, c.arguments) for c in result.tool_calls)
        deltas = [d async for d in client.stream("Book a room for Ann.", **kwargs)]
    streamed = collect_calls([c for d in deltas for c in d.tool_calls or ()])
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in result.tool_calls]
    assert deltas[-1].finish_reason == "tool_calls"


def test_an_agent_conversation_resent_each_turn_computes_only_its_new_tokens(server):
    """A 6-turn agent loop re-sent whole each turn computes, from turn 2 on, at most its new prompt tokens plus two blocks."""
    client = server.openai(KEY)
    serving = server.app[STATE].serving
    messages: list[Any] = [{"role": "system", "content": "You are a travel agent."}, *MESSAGES]
    previous: list[int] = []
    figures = []
    for turn in range(6):
        before = serving.stats()["prompt_tokens_computed"]
        out = client.chat.completions.create(
            model=server.model_name, messages=messages, tools=TOOLS, tool_choice="required" if turn < 5 else "none",
            parallel_tool_calls=False, max_tokens=200 if turn < 5 else 8, temperature=0.8, seed=turn,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        computed = serving.stats()["prompt_tokens_computed"] - before
        prompt = out.model_extra["prompt_token_ids"]
        assert prompt[: len(previous)] == previous  # the previous prompt is this one's prefix
        new = len(prompt) - len(previous)
        figures.append((len(prompt), new, computed))
        if turn:
            assert computed <= new + 2 * BLOCK_SIZE, figures
        reply = out.choices[0].message
        messages.append(reply)
        if turn < 5:
            assert out.choices[0].finish_reason == "tool_calls"
            messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": f"result {turn}"})
            messages.append({"role": "user", "content": "And next?"})
        previous = prompt
