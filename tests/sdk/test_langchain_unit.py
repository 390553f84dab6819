"""PagedChat / PagedLLM against LangChain's standard unit suite and over a fake engine."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_tests.unit_tests import ChatModelUnitTests
from paged_chat_capabilities import PagedChatCapabilities

from sdk import ClientSettings, ContentBlocked
from sdk.hooks import AuditLog, RegexFilter
from sdk.integrations.langchain import PagedChat, PagedLLM, to_sdk_messages
from sdk.tools import ToolCall, format_call


class TestPagedChatUnit(PagedChatCapabilities, ChatModelUnitTests):
    """LangChain's standard unit suite (construction, standard params, capability flags)."""


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


def test_chat_invoke_usage_and_metadata(fake_runtime):
    """invoke() returns the text with usage_metadata (incl. cache reads) and finish_reason/model_name."""
    chat = PagedChat(runtime=fake_runtime, max_tokens=5)
    result = chat.invoke([SystemMessage("Be brief."), HumanMessage("hi", name="bob")])
    assert isinstance(result, AIMessage)
    assert result.content == " The quick brown fox jumps"
    assert result.usage_metadata["output_tokens"] == 5
    assert result.usage_metadata["input_tokens"] > 0
    assert result.usage_metadata["input_token_details"] == {"cache_read": 0}
    assert result.response_metadata["finish_reason"] == "length"
    assert result.response_metadata["model_name"] == "fake-model"


def test_chat_stream_callbacks_and_stop(fake_runtime):
    """stream() yields one chunk per delta, fires on_llm_new_token, and honours stop sequences."""
    handler = Tokens()
    chat = PagedChat(runtime=fake_runtime, max_tokens=20, stop=["fox"], callbacks=[handler])
    chunks = list(chat.stream("hi"))
    assert "".join(c.content for c in chunks) == " The quick brown "
    assert chunks[-1].chunk_position == "last" and chunks[-1].response_metadata["finish_reason"] == "stop"
    assert [c for c in chunks if c.usage_metadata] == [chunks[-1]]
    assert "".join(handler.tokens) == " The quick brown "
    assert chat.invoke("hi", stop=["quick"]).content == " The "


async def test_chat_async_paths(fake_runtime):
    """ainvoke / astream / abatch run on the caller's loop and agree with the sync path."""
    chat = PagedChat(runtime=fake_runtime, max_tokens=4)
    text = (await chat.ainvoke("hi")).content
    assert "".join([c.content async for c in chat.astream("hi")]) == text
    assert [m.content for m in await chat.abatch(["a", "b"])] == [text, text]
    assert chat.invoke("hi", max_tokens=2).usage_metadata["output_tokens"] == 2


def test_chat_rejects_unsupported(fake_runtime):
    """Unknown per-call arguments, model overrides and image blocks are refused, not ignored."""
    chat = PagedChat(runtime=fake_runtime, max_tokens=2)
    with pytest.raises(ValueError, match="unsupported argument"):
        chat.invoke("hi", functions=[])
    with pytest.raises(ValueError, match="model override"):
        chat.invoke("hi", model="other")
    image = HumanMessage(content=[{"type": "image_url", "image_url": {"url": "http://x"}}])
    with pytest.raises(ValueError, match="text only"):
        chat.invoke([image])


def test_chat_hooks_apply(fake_runtime, tmp_path):
    """Hooks given to PagedChat run on its calls: input blocks raise, audit records carry the route."""
    audit = AuditLog(tmp_path / "a.jsonl")
    chat = PagedChat(runtime=fake_runtime, max_tokens=2, hooks=[RegexFilter("password"), audit], tenant="t1")
    chat.invoke("hello")
    with pytest.raises(ContentBlocked):
        chat.invoke("my password is hunter2")
    assert AuditLog.verify(audit.path) == 2
    assert '"route": "langchain"' in audit.path.read_text()


def test_adapters_take_client_settings_whole(fake_runtime):
    """``settings=`` gives both adapters their client whole (their route their own); with a settings field too, it is refused."""
    settings = ClientSettings(runtime=fake_runtime, tenant="t1")
    chat, llm = PagedChat(settings=settings, max_tokens=2), PagedLLM(settings=settings, max_tokens=2)
    assert chat.client.settings == PagedChat(runtime=fake_runtime, tenant="t1", max_retries=0).client.settings  # whole: its 0
    assert (chat.tenant, chat.client.settings.route, llm.client.settings.route) == ("t1", "langchain", "langchain")
    assert chat.invoke("hi").usage_metadata["output_tokens"] == 2
    with pytest.raises(ValueError, match="settings and tenant both given"):
        PagedChat(settings=settings, tenant="t2")


async def test_llm_complete_stream_and_usage(fake_runtime):
    """PagedLLM sends the raw prompt, streams text, and reports finish_reason and usage."""
    llm = PagedLLM(runtime=fake_runtime, max_tokens=3)
    text = llm.invoke("Once upon a time")
    assert text == " The quick brown"
    assert "".join(llm.stream("Once upon a time")) == text
    assert await llm.ainvoke("Once upon a time") == text
    assert "".join([t async for t in llm.astream("Once upon a time")]) == text
    result = llm.generate(["Once upon a time"])
    info = result.generations[0][0].generation_info
    assert info["finish_reason"] == "length" and info["usage"]["completion_tokens"] == 3


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Weather(BaseModel):
    """The weather in a city."""

    city: str


END = " END"  # one token: the fake engine does not hold back a stop sequence split across tokens


@pytest.fixture
def script(fake_engine, tokenizer):
    """``script(*calls)``: the fake engine replies 'Sure.' and these calls, then END (a stop sequence: it ends as 'stop')."""

    def set_script(*calls: ToolCall) -> None:
        text = "Sure." + "".join(map(format_call, calls)) + END
        fake_engine.script_ids = tokenizer.encode(text, add_special_tokens=False)

    return set_script


ADD = ToolCall(name="add", arguments={"a": 1, "b": 2})
PARIS = ToolCall(name="Weather", arguments={"city": "Paris"})


def test_bind_tools_binds_openai_tools_and_choice(fake_runtime):
    """Every tool spelling becomes an OpenAI tool; LangChain's tool-choice spellings become the SDK's."""
    chat = PagedChat(runtime=fake_runtime)
    bound = chat.bind_tools([add, Weather, {"name": "noop", "parameters": {"type": "object", "properties": {}}}])
    assert [t["function"]["name"] for t in bound.kwargs["tools"]] == ["add", "Weather", "noop"]
    assert "tool_choice" not in bound.kwargs
    named = {"type": "function", "function": {"name": "add"}}
    for choice, expected in [("any", "required"), ("required", "required"), ("auto", "auto"), ("none", "none"),
                             ("add", named), (named, named)]:  # fmt: skip
        assert chat.bind_tools([add, Weather], tool_choice=choice).kwargs["tool_choice"] == expected
    assert chat.bind_tools([add], tool_choice=True).kwargs["tool_choice"] == named
    assert chat.bind_tools([add], parallel_tool_calls=False).kwargs["parallel_tool_calls"] is False
    with pytest.raises(ValueError, match="exactly one tool"):
        chat.bind_tools([add, Weather], tool_choice=True)
    with pytest.raises(ValueError, match="unsupported argument"):
        chat.bind_tools([add], functions=[])


def test_tool_turns_become_sdk_messages():
    """An AI message's calls (text or list content) and a tool's result keep their ids."""
    call = {"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}
    listed = AIMessage([{"type": "text", "text": "Adding."}, {"type": "tool_use", "id": "c1", "name": "add", "input": {}}],
                       tool_calls=[call])  # fmt: skip
    ai, listed, result = to_sdk_messages([AIMessage("", tool_calls=[call]), listed, ToolMessage("3", tool_call_id="c1")])
    assert ai.content is None and ai.tool_calls == [ToolCall(id="c1", name="add", arguments={"a": 1, "b": 2})]
    assert listed.content == "Adding." and listed.tool_calls == ai.tool_calls
    assert (result.role, result.content, result.tool_call_id) == ("tool", "3", "c1")


def test_replies_and_streams_carry_tool_calls(script, fake_runtime):
    """invoke() parses calls into tool_calls; stream() chunks add up to the same calls."""
    script(ADD, PARIS)
    chat = PagedChat(runtime=fake_runtime, stop=[END]).bind_tools([add, Weather])
    reply = chat.invoke("Add 1 and 2, and the weather in Paris?")
    assert reply.content == "Sure." and reply.response_metadata["finish_reason"] == "tool_calls"
    assert [(c["name"], c["args"], c["type"]) for c in reply.tool_calls] == [
        ("add", {"a": 1, "b": 2}, "tool_call"), ("Weather", {"city": "Paris"}, "tool_call")]  # fmt: skip
    assert all(c["id"].startswith("call_") for c in reply.tool_calls) and reply.usage_metadata["output_tokens"] > 0
    chunks = list(chat.stream("again"))
    assert any(c.tool_call_chunks for c in chunks)
    full = sum(chunks[1:], chunks[0])
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]
    assert full.response_metadata["finish_reason"] == "tool_calls"


async def test_structured_output_by_function_calling(script, fake_runtime):
    """method='function_calling' forces the schema's tool and returns its first call's arguments."""
    script(PARIS, PARIS)
    chat = PagedChat(runtime=fake_runtime, stop=[END])
    weather = chat.with_structured_output(Weather, method="function_calling")
    assert weather.first.kwargs["tool_choice"] == {"type": "function", "function": {"name": "Weather"}}
    assert weather.first.kwargs["parallel_tool_calls"] is False
    assert await weather.ainvoke("Paris?") == Weather(city="Paris")
    raw = await chat.with_structured_output(Weather, method="function_calling", include_raw=True).ainvoke("Paris?")
    assert raw["parsed"] == Weather(city="Paris") and raw["parsing_error"] is None and len(raw["raw"].tool_calls) == 2
    as_dict = chat.with_structured_output(Weather.model_json_schema(), method="function_calling")
    assert await as_dict.ainvoke("Paris?") == {"city": "Paris"}
