"""`paged serve` with a pooling model beside the chat model: both listed, each request routed by its `model`
(a pooling route without one goes to the embedder), each model refusing the other's work by name."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import numpy as np
import pytest

from engine import Engine
from engine.llm_engine import Engine as LLMEngine
from engine.chat_pace import CHAT_PACE
from integrations.openai_server.app import create_app
from integrations.openai_server.state import STATE

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France."]
HI = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def minilm(shipped_minilm_dir):
    return Engine(model=str(shipped_minilm_dir), dtype="float32", device="cpu")


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    async def go() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.post(server.root + path, json=body) as resp:
                return resp.status, await resp.json()

    return server.call(go())


class _StepWatch:
    """Wraps ``Engine.step_deltas``: how many engines step at once, at most, and how many steps ran."""

    def __init__(self, step):
        self.step, self.now, self.most, self.count = step, 0, 0, 0
        self.lock = threading.Lock()

    def __call__(self, engine):
        with self.lock:
            self.now += 1
            self.count += 1
            self.most = max(self.most, self.now)
        try:
            return self.step(engine)
        finally:
            with self.lock:
                self.now -= 1


def test_chat_and_embeddings_on_one_server(live_server, shipped_minilm_dir, minilm, monkeypatch):
    watch = _StepWatch(LLMEngine.step_deltas)
    monkeypatch.setattr(LLMEngine, "step_deltas", lambda engine: watch(engine))  # a function: bound per engine
    app = create_app(pooling_models=[str(shipped_minilm_dir)], dtype="float32", num_blocks=64, max_num_seqs=4)
    server = live_server(app)
    client = server.openai("unused")
    ids = [m.id for m in client.models.list().data]
    chat_model, embed_model = ids
    assert embed_model == minilm.model_name and chat_model != embed_model
    expected = [o.outputs.embedding for o in minilm.embed(TEXTS)]
    for name in (None, embed_model):  # a pooling route without a model goes to the embedder
        body = {"input": TEXTS} | ({"model": name} if name else {})
        status, answer = _post(server, "/v1/embeddings", body)
        assert status == 200 and answer["model"] == embed_model
        np.testing.assert_allclose([d["embedding"] for d in answer["data"]], expected, atol=1e-5)
    reply = client.chat.completions.create(model=chat_model, messages=HI, max_tokens=8, temperature=0)
    assert reply.model == chat_model and reply.choices[0].message.content
    status, answer = _post(server, "/v1/chat/completions", {"model": embed_model, "messages": HI, "max_tokens": 4})
    assert status == 400 and answer["error"]["param"] == "model" and "cannot generate" in answer["error"]["message"]
    status, answer = _post(server, "/v1/embeddings", {"model": chat_model, "input": "x"})
    assert status == 400 and answer["error"]["param"] == "model" and "cannot embed" in answer["error"]["message"]

    async def both() -> tuple[int, int]:  # a chat and a burst of embeddings at once: both engines answer
        async with aiohttp.ClientSession() as session:
            async def post(path: str, body: dict) -> int:
                async with session.post(server.root + path, json=body) as resp:
                    await resp.read()
                    return resp.status

            chat = post("/v1/chat/completions", {"messages": HI, "max_tokens": 16})
            embeds = [post("/v1/embeddings", {"input": TEXTS * 8}) for _ in range(8)]
            statuses = await asyncio.gather(chat, *embeds)
            return statuses[0], max(statuses[1:])

    steps = watch.count
    assert server.call(both()) == (200, 200)
    assert watch.count > steps and watch.most == 1  # the two engines stepped in turn, never at once
    embedder = server.app[STATE].beside[embed_model].engine
    assert server.call(embedder.call(lambda e: e.pooling.pace)) is CHAT_PACE  # it yields to the chat model's steps

    async def scrape() -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(server.root + "/metrics") as resp:
                return await resp.text()

    # /metrics: the chat engine's figures, and the embedder's batches beside it
    text = server.call(scrape())
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("paged_")}
    embedded = embedder.stats()["pooling"]["embed"]
    assert samples['paged_pooling_inputs_total{kind="embed"}'] == embedded["inputs"] >= 2 * len(TEXTS) + 8 * 16
    assert samples['paged_pooling_batches_total{kind="embed"}'] == embedded["batches"]
    assert samples['paged_pooling_tokens_total{kind="embed"}'] == embedded["tokens"]
    assert samples["paged_generation_tokens_total"] > 0
