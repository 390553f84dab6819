"""A thinking model over HTTP: ``reasoning_content`` apart from ``content``, streamed and not, read by
the official openai client and by the SDK's remote client; ``chat_template_kwargs`` reach the template."""

from __future__ import annotations

import asyncio

import openai
import pytest

from integrations.openai_server.app import create_app
from integrations.openai_server.serving import Serving
from sdk import AsyncClient
from tests.support.thinking import CALL, REPLY, THINKING_TEMPLATE, TOOLS, ScriptedReplyEngine

KEY = "sk-reasoning-key"
REASONING = "The user greets me. I greet back.\n"


@pytest.fixture
def serve(live_server, bundled_model_dir):
    def make(reply: str, reasoning_parser: str = "auto"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir, local_files_only=True)
        tokenizer.chat_template = THINKING_TEMPLATE
        engine = ScriptedReplyEngine(tokenizer, reply)
        factory = lambda: Serving(engine, reasoning_parser=reasoning_parser)  # noqa: E731
        server = live_server(create_app(api_key=KEY, serving_factory=factory))
        return server, engine, openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=10)

    return make


def test_reasoning_content_comes_apart_streamed_and_not(serve):
    _, _, client = serve(REPLY)
    message = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}]).choices[0].message
    assert (message.content, message.reasoning_content) == ("Hello there!", REASONING)
    chunks = list(client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "Hi"}], stream=True
    ))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == "Hello there!"
    assert all(getattr(d, "reasoning_content", None) is None or not d.content for d in deltas)


def test_a_tool_call_after_the_thinking_over_http(serve):
    _, _, client = serve("<think>\nI should add.</think>\n\n" + CALL)
    choice = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "Add"}],
        tools=[t.model_dump(exclude_none=True) for t in TOOLS], tool_choice="required",
    ).choices[0]  # fmt: skip
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content, choice.message.reasoning_content) == (None, "I should add.")
    assert choice.message.tool_calls[0].function.arguments == '{"a": 1}'


def test_chat_template_kwargs_and_no_parser(serve):
    server, engine, client = serve(REPLY, reasoning_parser="none")
    message = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "Hi"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    ).choices[0].message  # fmt: skip
    assert (message.content, getattr(message, "reasoning_content", None)) == (REPLY, None)
    assert engine.tokenizer.decode(engine.prompts[0]).rstrip().endswith("<think>\n\n</think>")
    bad = {"chat_template_kwargs": {"add_generation_prompt": False}}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], extra_body=bad)
    assert exc.value.body["param"] == "chat_template_kwargs"


def test_the_remote_sdk_client_reads_the_reasoning(serve):
    server, engine, _ = serve(REPLY)

    async def run():
        client = AsyncClient(base_url=server.base_url, api_key=KEY)
        try:
            result = await client.chat("Hi", chat_template_kwargs={"enable_thinking": True})
            streamed = [d async for d in client.stream("Hi")]
        finally:
            await client.aclose()
        return result, streamed

    result, streamed = asyncio.run(run())
    assert (result.reasoning, result.text) == (REASONING, "Hello there!")
    assert "".join(d.reasoning for d in streamed) == REASONING
