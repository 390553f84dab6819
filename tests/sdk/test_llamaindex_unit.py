"""LlamaIndex PagedLLM over a fake engine: one contract test for sync, async, stream and complete."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.base.llms.types import ChatMessage, MessageRole

from sdk import ClientSettings
from sdk.integrations.llamaindex import PagedLLM

EXPECTED = " The quick brown"


async def test_llamaindex_contract(fake_runtime):
    """chat/complete and their stream/async variants agree; metadata describes a chat model."""
    llm = PagedLLM(runtime=fake_runtime, max_tokens=3)
    assert BaseLLM in PagedLLM.__mro__
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Be brief."), ChatMessage(role=MessageRole.USER, content="Hi")]
    chat = llm.chat(messages)
    assert chat.message.role == MessageRole.ASSISTANT and chat.message.content == EXPECTED
    assert chat.additional_kwargs["finish_reason"] == "length"
    assert chat.additional_kwargs["usage"]["completion_tokens"] == 3
    assert (await llm.achat(messages)).message.content == EXPECTED
    streamed = list(llm.stream_chat(messages))
    assert "".join(r.delta for r in streamed) == EXPECTED and streamed[-1].message.content == EXPECTED
    assert [r.delta async for r in await llm.astream_chat(messages)] == [r.delta for r in streamed]
    assert llm.complete("Hi").text == EXPECTED
    assert (await llm.acomplete("Hi")).text == EXPECTED
    assert list(llm.stream_complete("Hi"))[-1].text == EXPECTED
    assert [r.text async for r in await llm.astream_complete("Hi")][-1] == EXPECTED
    assert llm.complete("raw text", formatted=True).additional_kwargs["usage"]["prompt_tokens"] == 2
    meta = llm.metadata
    assert meta.is_chat_model and meta.num_output == 3
    assert meta.context_window == 512 and meta.model_name == "fake-model"


def test_llamaindex_settings_checked_at_construction(fake_runtime):
    """The client is built with the adapter: ``settings=`` is taken whole, and contradicting settings fail at once."""
    llm = PagedLLM(settings=ClientSettings(runtime=fake_runtime, tenant="t"), max_tokens=3)
    assert (llm.tenant, llm.client.settings.route) == ("t", "llamaindex")
    assert llm.complete("Hi").text == EXPECTED
    with pytest.raises(ValueError, match=r"base_url and engine fields \(num_blocks\)"):
        PagedLLM(base_url="http://127.0.0.1:1", engine_config={"num_blocks": 8})
    with pytest.raises(ValueError, match="settings and model, tenant both given"):
        PagedLLM(settings=ClientSettings(), model="m", tenant="t")
