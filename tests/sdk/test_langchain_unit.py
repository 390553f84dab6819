"""PagedChat / PagedLLM against LangChain's standard unit suite and over a fake engine."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.unit_tests import ChatModelUnitTests
from paged_chat_capabilities import PagedChatCapabilities

from sdk import ContentBlocked
from sdk.hooks import AuditLog, RegexFilter
from sdk.integrations.langchain import PagedChat, PagedLLM


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
        chat.invoke("hi", tools=[])
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
