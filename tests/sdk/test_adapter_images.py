"""Images through the framework adapters: LangChain's image content blocks (and its standard image tests) and
LlamaIndex's ImageBlock, on a tiny random-weight LLaVA, answered as the SDK client answers the same chat."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from llama_index.core.base.llms.types import ChatMessage as LIChatMessage
from llama_index.core.base.llms.types import ImageBlock, TextBlock
from paged_chat_capabilities import PagedChatCapabilities

from sdk import AsyncClient, Runtime
from sdk.errors import InvalidRequestError
from sdk.integrations import langchain as lc
from sdk.integrations import llamaindex as li
from sdk.integrations.langchain import PagedChat
from sdk.integrations.llamaindex import PagedLLM
from sdk.types import ImagePart, TextPart
from tests.support.images import data_url, image_part, noise_png

PNG = noise_png((40, 30))
B64 = base64.b64encode(PNG).decode()
URL = data_url(PNG)
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
ENGINE_CONFIG = dict(dtype="float32", device="cpu", block_size=4, num_blocks=256, max_num_seqs=8, max_model_len=512)


@pytest.mark.parametrize(
    "block",
    [
        {"type": "image_url", "image_url": {"url": URL}},
        {"type": "image_url", "image_url": URL},
        {"type": "image", "base64": B64, "mime_type": "image/png"},
        {"type": "image", "base64": B64},  # no MIME type: read from the bytes
        {"type": "image", "source_type": "base64", "data": B64, "mime_type": "image/png"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
    ],
    ids=["openai", "openai-bare-url", "standard", "standard-no-mime", "standard-v0", "anthropic"],
)
def test_langchain_image_blocks_become_image_parts(block: dict) -> None:
    [message] = lc.to_sdk_messages([HumanMessage(content=[{"type": "text", "text": "What is it?"}, block])])
    assert message.content == [TextPart(text="What is it?"), ImagePart.of(URL)]


def test_langchain_image_urls_and_text_only_blocks() -> None:
    [message] = lc.to_sdk_messages([HumanMessage(content=[{"type": "image", "url": "https://example.com/a.png"}])])
    assert message.content == [ImagePart.of("https://example.com/a.png")]
    [text] = lc.to_sdk_messages([HumanMessage(content=[{"type": "text", "text": "a"}, "b"])])
    assert text.content == "ab"  # text-only content stays a string, as before
    with pytest.raises(ValueError, match="unsupported image block"):
        lc.to_sdk_messages([HumanMessage(content=[{"type": "image", "file_id": "file-123"}])])
    with pytest.raises(ValueError, match="unsupported content block type 'audio'"):
        lc.to_sdk_messages([HumanMessage(content=[{"type": "audio", "base64": B64, "mime_type": "audio/wav"}])])


def test_llamaindex_image_blocks_become_image_parts(tmp_path: Path) -> None:
    path = tmp_path / "cat.png"
    path.write_bytes(PNG)
    blocks = [TextBlock(text="Compare"), ImageBlock(image=PNG), TextBlock(text="with"), ImageBlock(path=path),
              ImageBlock(url="https://example.com/a.png")]  # fmt: skip
    [message] = li.to_sdk_messages([LIChatMessage(role="user", blocks=blocks)])
    assert message.content == [
        TextPart(text="Compare"), ImagePart.of(URL), TextPart(text="with"), ImagePart.of(URL), ImagePart.of("https://example.com/a.png"),
    ]  # fmt: skip
    [text] = li.to_sdk_messages([LIChatMessage(role="user", content="plain")])
    assert text.content == "plain"


# --------------------------------------------------------------------------- on the tiny LLaVA


@pytest.fixture(scope="module")
def llava(tiny_model_factory) -> Iterator[Runtime]:
    """One engine over the tiny LLaVA, shared by the module's adapters and clients."""
    runtime = Runtime(str(tiny_model_factory("llava")), **ENGINE_CONFIG)
    yield runtime
    runtime.close()


def _sdk_text(runtime: Runtime, content: list[dict]) -> str:
    async def ask() -> str:
        client = AsyncClient(runtime=runtime)
        return (await client.chat([{"role": "user", "content": content}], **GREEDY)).text

    return runtime.run_sync(ask())


def test_paged_chat_answers_image_blocks_as_the_sdk_does(llava: Runtime) -> None:
    chat = PagedChat(runtime=llava, **GREEDY)
    expected = _sdk_text(llava, [{"type": "text", "text": "What is it?"}, image_part(URL)])
    for block in ({"type": "image_url", "image_url": {"url": URL}}, {"type": "image", "base64": B64, "mime_type": "image/png"}):
        message = HumanMessage(content=[{"type": "text", "text": "What is it?"}, block])
        assert chat.invoke([message]).content == expected
        assert "".join(c.content for c in chat.stream([message])) == expected
    assert _sdk_text(llava, [{"type": "text", "text": "What is it?"}, image_part(data_url(noise_png((40, 30), seed=1)))]) != expected


def test_paged_chat_on_a_text_model_refuses_images(fake_runtime) -> None:
    chat = PagedChat(runtime=fake_runtime, max_tokens=2)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        chat.invoke([HumanMessage(content=[{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": URL}}])])
    assert chat.invoke("still serving").content


async def test_llamaindex_image_blocks_are_answered_as_the_sdk_does(llava: Runtime) -> None:
    llm = PagedLLM(runtime=llava, **GREEDY)
    expected = _sdk_text(llava, [{"type": "text", "text": "What is it?"}, image_part(URL)])
    message = LIChatMessage(role="user", blocks=[TextBlock(text="What is it?"), ImageBlock(image=PNG)])
    assert llm.chat([message]).message.content == expected
    assert (await llm.achat([message])).message.content == expected


class _StandardImageTests(PagedChatCapabilities, ChatModelIntegrationTests):
    """LangChain's standard suite with image inputs on (not collected: only its image tests run, below)."""

    @property
    def supports_image_inputs(self) -> bool:
        return True

    @property
    def supports_image_tool_message(self) -> bool:
        return True

    @property
    def supports_image_urls(self) -> bool:
        return False  # remote URLs need the server's allow-list: the in-process default refuses them


@pytest.mark.parametrize("name", ["test_image_inputs", "test_image_tool_message"])
def test_langchain_standard_image_tests(llava: Runtime, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The suite's own image tests, its image download served from here (no network in tests)."""
    import langchain_tests.integration_tests.chat_models as suite

    class _Download:
        content = PNG

    monkeypatch.setattr(suite.httpx, "get", lambda url, **kwargs: _Download())
    chat = PagedChat(runtime=llava, max_tokens=4, temperature=0.0)
    getattr(_StandardImageTests(), name)(chat)


def test_paged_chat_sends_image_tool_results(llava: Runtime) -> None:
    """A tool's image result reaches the model as an image (the default tool prompt wraps it)."""
    chat = PagedChat(runtime=llava, **GREEDY)
    call = AIMessage("", tool_calls=[{"type": "tool_call", "id": "1", "name": "photo", "args": {}}])

    def run(image: bytes) -> Any:
        result = ToolMessage(content=[{"type": "image", "base64": base64.b64encode(image).decode(), "mime_type": "image/png"}], tool_call_id="1")
        return chat.invoke([HumanMessage("Take a photo and describe it."), call, result]).content

    assert run(PNG) == run(PNG) != run(noise_png((40, 30), seed=1))
