"""The LangChain and LlamaIndex adapters over ``base_url``: the real server, same greedy text as in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from integrations.openai_server.app import create_app
from sdk.client import AsyncClient
from sdk.errors import AuthenticationError
from sdk.sync import Client

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-remote"
ENGINE_CONFIG = dict(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256)
MESSAGES = [("system", "You are terse."), ("human", "Count to five.")]
SAMPLING = dict(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    """One key-protected server over the tiny llama for the module (engine load is the slow part)."""
    from tests.integrations.conftest import LiveServer

    live = LiveServer(create_app(model_dir, api_key=KEY, **ENGINE_CONFIG)).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def local_chat(model_dir):
    """The in-process reference: same model, same sampling."""
    from sdk.integrations.langchain import PagedChat

    return PagedChat(model=model_dir, engine_config=ENGINE_CONFIG, **SAMPLING)


def test_client_rejects_contradicting_settings():
    """base_url with transport, engine fields, or api_key alone is a ValueError naming the fields."""
    from sdk.integrations.langchain import PagedChat
    from sdk.runtime import Runtime
    from sdk.transport import InProcessTransport

    with pytest.raises(ValueError, match="transport and base_url, api_key"):
        AsyncClient(base_url="http://127.0.0.1:1", api_key="k", transport=InProcessTransport(Runtime()))
    with pytest.raises(ValueError, match=r"base_url and engine fields \(block_size, num_blocks\)"):
        Client(base_url="http://127.0.0.1:1", num_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="api_key given without base_url"):
        AsyncClient(api_key="k")
    with pytest.raises(ValueError, match=r"engine fields \(num_blocks\)"):
        PagedChat(base_url="http://127.0.0.1:1", engine_config={"num_blocks": 8})


def test_langchain_invoke_and_stream_match_in_process(server, local_chat):
    """PagedChat(base_url=...) invoke and stream give the in-process greedy text and the same usage."""
    from sdk.integrations.langchain import PagedChat

    remote = PagedChat(base_url=server.base_url, api_key=KEY, **SAMPLING)
    try:
        assert "sk-remote" not in repr(remote)
        expected = local_chat.invoke(MESSAGES)
        reply = remote.invoke(MESSAGES)
        assert reply.content == expected.content and expected.content
        assert reply.usage_metadata["input_tokens"] == expected.usage_metadata["input_tokens"]
        assert reply.usage_metadata["output_tokens"] == 6
        assert reply.response_metadata["model_name"] == expected.response_metadata["model_name"]
        assert "".join(chunk.content for chunk in remote.stream(MESSAGES)) == expected.content
    finally:
        remote.client.close()


async def test_langchain_ainvoke_matches_in_process(server, local_chat):
    """PagedChat(base_url=...).ainvoke runs on the caller's loop and gives the in-process greedy text."""
    from sdk.integrations.langchain import PagedChat

    remote = PagedChat(base_url=server.base_url, api_key=KEY, **SAMPLING)
    try:
        expected = await local_chat.ainvoke(MESSAGES)
        assert (await remote.ainvoke(MESSAGES)).content == expected.content
    finally:
        await remote.aclient.aclose()


def test_llamaindex_complete_and_chat_over_base_url(server, model_dir):
    """LlamaIndex PagedLLM(base_url=...) complete and chat give the in-process greedy text."""
    from llama_index.core.base.llms.types import ChatMessage

    from sdk.integrations.llamaindex import PagedLLM

    remote = PagedLLM(base_url=server.base_url, api_key=KEY, **SAMPLING)
    local = PagedLLM(model=model_dir, engine_config=ENGINE_CONFIG, **SAMPLING)
    try:
        assert "sk-remote" not in repr(remote) and "api_key" not in remote.to_dict()
        completion = remote.complete("Name a colour.")
        assert completion.text == local.complete("Name a colour.").text
        assert completion.additional_kwargs["usage"]["completion_tokens"] == 6
        messages = [ChatMessage(role="system", content="You are terse."), ChatMessage(role="user", content="Hi")]
        assert remote.chat(messages).message.content == local.chat(messages).message.content
        assert remote.metadata.context_window == ENGINE_CONFIG["max_model_len"]
    finally:
        remote.client.close()


@pytest.mark.parametrize("api_key", ["sk-wrong", None])
def test_wrong_api_key_raises_authentication_error(server, api_key):
    """A refused key (401) is sdk.errors.AuthenticationError through the adapters, not a generic failure."""
    from sdk.integrations.langchain import PagedChat
    from sdk.integrations.llamaindex import PagedLLM

    chat = PagedChat(base_url=server.base_url, api_key=api_key, **SAMPLING)
    llm = PagedLLM(base_url=server.base_url, api_key=api_key, **SAMPLING)
    try:
        with pytest.raises(AuthenticationError, match="API key"):
            chat.invoke("hi")
        with pytest.raises(AuthenticationError):
            llm.complete("hi")
    finally:
        chat.client.close()
        llm.client.close()


def test_remote_adapters_close_their_sessions_at_exit_or_when_closed(server):
    """A remote PagedChat left open is closed at interpreter exit, ``async with`` closes one on the caller's loop,
    and a LlamaIndex PagedLLM closes with ``with``: no "Unclosed client session" warning."""
    script = f"""
import asyncio
from sdk.integrations.langchain import PagedChat
from sdk.integrations.llamaindex import PagedLLM

left_open = PagedChat(base_url={server.base_url!r}, api_key={KEY!r}, max_tokens=2)
left_open.invoke("hi")

async def main():
    async with PagedChat(base_url={server.base_url!r}, api_key={KEY!r}, max_tokens=2) as chat:
        await chat.ainvoke("hi")

asyncio.run(main())
with PagedLLM(base_url={server.base_url!r}, api_key={KEY!r}, max_tokens=2) as llm:
    llm.complete("hi")
print("served")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "always"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "served" in done.stdout, done.stderr
    assert "unclosed" not in done.stderr.lower(), done.stderr
