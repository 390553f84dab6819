"""Structured output's acceptance on the bundled model: 100 extraction prompts with a nested schema,
every reply valid, in process, through ``PagedChat.with_structured_output`` and through the server
with the official openai client, all three on one engine."""

from __future__ import annotations

import asyncio

import openai
import pytest

from integrations.openai_server.app import create_app
from integrations.openai_server.serving import Serving
from sdk import AsyncClient, Runtime
from tests.support.extraction import MAX_TOKENS, PROMPTS, SCHEMA_MODEL, messages, validate


@pytest.fixture(scope="module")
def runtime():
    with Runtime(max_num_seqs=64) as runtime:
        runtime.run_sync(runtime.start())
        yield runtime


async def test_in_process(runtime) -> None:
    results = await AsyncClient(runtime=runtime).batch(
        [messages(p) for p in PROMPTS], response_format=SCHEMA_MODEL, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert [r.finish_reason for r in results] == ["stop"] * len(PROMPTS)
    for result in results:
        assert validate(result.text) == result.parsed


async def test_paged_chat_with_structured_output(runtime) -> None:
    from sdk.integrations.langchain import PagedChat

    chat = PagedChat(runtime=runtime, max_tokens=MAX_TOKENS, temperature=0.0)
    replies = await chat.with_structured_output(SCHEMA_MODEL).abatch([messages(p) for p in PROMPTS])
    assert len(replies) == len(PROMPTS)
    for reply in replies:
        assert isinstance(reply, SCHEMA_MODEL)
        validate(reply)


async def test_paged_serve_with_the_openai_client(runtime, live_server) -> None:
    app = create_app(api_key="sk-acceptance", serving_factory=lambda: Serving(runtime.engine, owns_engine=False))
    server = live_server(app)
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-acceptance", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    completions = await asyncio.gather(*(
        client.chat.completions.parse(
            model=model, messages=messages(p), response_format=SCHEMA_MODEL, max_tokens=MAX_TOKENS, temperature=0
        )
        for p in PROMPTS
    ))  # fmt: skip
    for completion in completions:
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, SCHEMA_MODEL) and validate(message.content) == message.parsed
    await client.close()
