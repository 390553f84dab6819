"""One Runtime holding a chat model and an embedder: chat, embed and rerank from one client, the embedder yielding
to the chat model's steps, and chat decodes going on while an embedding burst runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

from engine.chat_pace import CHAT_PACE
from sdk import AsyncClient, Client, Runtime
from sdk.hooks import AuditLog
from tests.support.minilm import shipped_minilm_dir

MINILM = str(shipped_minilm_dir())
DOCS = ["Berlin is in Germany.", "Paris is the capital of France.", "Cats chase mice."]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module")
def chat_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference():
    from engine import Engine

    return Engine(model=MINILM, dtype="float32", device="cpu")


def test_one_runtime_serves_chat_embed_and_rerank(chat_dir, reference, tmp_path) -> None:
    """A client of the runtime chats on the chat model and embeds / reranks on the embedder (its answers, its
    name in results and audit records); the embedder yields to the chat model; close() stops both engines."""
    audit = tmp_path / "audit.jsonl"
    with Runtime(str(chat_dir), embedding_model=MINILM, dtype="float32", num_blocks=64) as runtime:
        client = Client(runtime=runtime, hooks=[AuditLog(audit)])
        reply = client.chat("Hello", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
        chat_model = client.model_name
        embedded = client.embed(DOCS)
        np.testing.assert_allclose(embedded.embeddings, [o.outputs.embedding for o in reference.embed(DOCS)], atol=1e-6)
        assert embedded.model == reference.model_name != client.model_name
        ranked = client.rerank(QUERY, DOCS, top_n=1)
        assert ranked.results[0].index == 1 and ranked.model == reference.model_name
        embedder = runtime.pooling_engine("embed")
        assert embedder is not runtime.engine and runtime.pooling_engine("score") is embedder
        assert runtime.run_sync(embedder.call(lambda e: e.pooling.pace)) is CHAT_PACE  # it yields to the chat model
        assert client.stats()["pooling_requests"] == len(DOCS) + 1 + len(DOCS)  # rerank: the query once, each document
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["kind"], r["model"]) for r in records] == [
        ("chat", chat_model), ("embed", reference.model_name), ("rerank", reference.model_name)
    ]
    assert embedder.health().status != "running" and runtime.closed


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory) -> Path:
    """A seeded tiny random BertForSequenceClassification (one label) with MiniLM's tokenizer."""
    import shutil

    import torch
    import transformers

    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=128, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-cross-encoder")
    transformers.BertForSequenceClassification(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(MINILM) / name, out / name)
    return out


def test_a_reranker_beside_the_embedder_scores_the_pairs(chat_dir, cross_encoder_dir, reference) -> None:
    """With ``rerank_model``, rerank and score run on the cross-encoder (its scores and name) and embed stays on
    the embedding model."""
    from engine import Engine

    cross = Engine(model=str(cross_encoder_dir), dtype="float32", device="cpu")
    expected = [o.outputs.score for o in cross.score(QUERY, DOCS)]
    with Runtime(str(chat_dir), embedding_model=MINILM, rerank_model=str(cross_encoder_dir), dtype="float32") as runtime:
        client = Client(runtime=runtime)
        scored = client.score(QUERY, DOCS)
        np.testing.assert_allclose(scored.scores, expected, atol=1e-5)
        assert scored.model == cross.model_name
        ranked = client.rerank(QUERY, DOCS)
        assert [r.index for r in ranked.results] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
        assert client.embed(DOCS[0]).model == reference.model_name
        assert runtime.pooling_engine("score") is not runtime.pooling_engine("embed")


def test_engine_with_a_pooling_model_is_refused() -> None:
    """A given engine is configured already: a pooling model beside it is a contradiction, said by name."""
    with pytest.raises(ValueError, match="embedding_model"):
        Runtime(engine=object(), embedding_model=MINILM)  # type: ignore[arg-type]


async def test_chat_decodes_while_an_embedding_burst_runs(chat_dir) -> None:
    """With 120 max-length inputs queued on the embedder, a 12-token chat reply finishes while most of the burst
    still waits: the engines take turns, the embedder's a bounded part of a chat step, so the burst does not hold
    the chat model's decodes until it is done."""
    runtime = Runtime(str(chat_dir), embedding_model=MINILM, dtype="float32", num_blocks=64)
    burst: list[asyncio.Future] = []
    try:
        client = AsyncClient(runtime=runtime)
        await client.start()
        long_text = "retrieval augmented generation over paged attention " * 60  # cut at MiniLM's 256 tokens
        burst += [asyncio.ensure_future(client.embed(long_text)) for _ in range(120)]
        done, _ = await asyncio.wait(burst, return_when=asyncio.FIRST_COMPLETED)  # the burst is running
        reply = await client.chat("Hello", max_tokens=12, temperature=0, ignore_eos=True)
        answered = sum(task.done() for task in burst)
        assert reply.usage.completion_tokens == 12
        assert answered < len(burst) // 2, f"{answered} of {len(burst)} embeddings were answered before the chat ended"
        results = await asyncio.gather(*burst)
        assert all(r.usage.prompt_tokens == 256 for r in results)
    finally:
        for task in burst:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*burst, return_exceptions=True)
        await runtime.aclose()
