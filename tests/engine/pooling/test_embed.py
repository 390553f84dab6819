"""Embeddings of the shipped MiniLM: equal to sentence-transformers', batched == alone, errors typed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from engine import AsyncEngine, EmbeddingRequestOutput, Engine, PoolingParams, UnsupportedTask
from engine.errors import ParameterError, RequestRejected

SENTENCES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Ünïcödé àccents and 中文字符 mixed with emoji 🙂",
    "a",
    "retrieval " * 400,  # over the model's 256 tokens: cut as sentence-transformers cuts
    " ".join(f"word{i}" for i in range(700)),
]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def _vectors(outputs: list[EmbeddingRequestOutput]) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outputs])


def test_embeddings_equal_sentence_transformers(minilm_engine: Engine, sentence_transformer) -> None:
    """Every test sentence's float32 embedding has cosine >= 0.99999 with sentence-transformers' and is unit-length."""
    outputs = minilm_engine.embed(SENTENCES)
    reference = sentence_transformer.encode(SENTENCES, convert_to_numpy=True)
    ours = _vectors(outputs)
    assert ours.shape == reference.shape == (len(SENTENCES), 384)
    assert _cosines(ours, reference).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)
    assert max(len(o.prompt_token_ids) for o in outputs) == 256  # the model's max_seq_length
    assert all(o.finished for o in outputs) and len({o.request_id for o in outputs}) == len(SENTENCES)


def test_batched_equals_alone(minilm_engine: Engine) -> None:
    """An input embedded in a batch of others gets the embedding it gets alone."""
    batched = _vectors(minilm_engine.embed(SENTENCES))
    alone = np.array([minilm_engine.embed(s)[0].outputs.embedding for s in SENTENCES])
    np.testing.assert_allclose(batched, alone, atol=2e-6)


def test_token_ids_and_params(minilm_engine: Engine) -> None:
    """Token-id input equals its text; normalize=False returns the raw mean pool; truncation keeps the first tokens."""
    text = SENTENCES[1]
    [by_text] = minilm_engine.embed(text)
    [by_ids] = minilm_engine.embed([by_text.prompt_token_ids])
    np.testing.assert_allclose(by_ids.outputs.embedding, by_text.outputs.embedding, atol=1e-6)
    [raw] = minilm_engine.embed(text, PoolingParams(normalize=False))
    assert abs(np.linalg.norm(raw.outputs.embedding) - 1.0) > 1e-3
    np.testing.assert_allclose(
        np.array(raw.outputs.embedding) / np.linalg.norm(raw.outputs.embedding), by_text.outputs.embedding, atol=1e-6
    )
    [short] = minilm_engine.embed(text, PoolingParams(truncate_prompt_tokens=5))
    assert short.prompt_token_ids == by_text.prompt_token_ids[:4] + [by_text.prompt_token_ids[-1]]  # [CLS] 3 [SEP]


def test_bad_input_is_refused_by_name(minilm_engine: Engine) -> None:
    """Empty input, an over-long input with truncation off, and Matryoshka dimensions on a model without them are
    refused naming the field; the engine serves the next request."""
    with pytest.raises(RequestRejected) as empty:
        minilm_engine.embed(["fine", ""])
    assert empty.value.param == "prompt"
    with pytest.raises(RequestRejected, match="over the model's 256") as long:
        minilm_engine.embed(SENTENCES[5], PoolingParams(truncate_prompt_tokens=None))
    assert long.value.param == "prompt"
    with pytest.raises(ParameterError) as dims:
        minilm_engine.embed("x", PoolingParams(dimensions=128))
    assert dims.value.param == "dimensions"
    with pytest.raises(ParameterError) as prompts:
        minilm_engine.embed([])
    assert prompts.value.param == "prompts"
    with pytest.raises(ParameterError):
        PoolingParams(truncate_prompt_tokens=0)
    with pytest.raises(RequestRejected, match=r"vocabulary \[0, 30522\)"):
        minilm_engine.embed([[101, 30522, 102]])
    assert len(minilm_engine.embed("still serving")[0].outputs.embedding) == 384


def test_embedding_model_refuses_to_generate(minilm_engine: Engine) -> None:
    """An embedding model asked to generate raises UnsupportedTask naming the model; it reserved no KV cache."""
    with pytest.raises(UnsupportedTask, match="is an embedding model: it cannot generate") as error:
        minilm_engine.generate(["hi"])
    assert error.value.param == "model" and error.value.model_task == "embed"
    assert minilm_engine.task == "embed" and minilm_engine.runner.num_blocks == 1
    assert not hasattr(minilm_engine.runner, "kv_caches")


def test_chat_model_refuses_to_embed(tiny_model_factory) -> None:
    """A generative model asked to embed or score raises UnsupportedTask naming it."""
    engine = Engine(model=str(tiny_model_factory("llama")), num_blocks=8)
    with pytest.raises(UnsupportedTask, match="is a generative model: it cannot embed"):
        engine.embed("hi")
    with pytest.raises(UnsupportedTask, match="cannot score"):
        engine.score("q", ["d"])


def test_score_by_cosine(minilm_engine: Engine) -> None:
    """An embedding model's score is the cosine of the query's and each document's embeddings."""
    query, docs = "a fox", ["The quick brown fox jumps over the lazy dog.", "Paged attention"]
    scores = [s.outputs.score for s in minilm_engine.score(query, docs)]
    vectors = _vectors(minilm_engine.embed([query, *docs]))
    np.testing.assert_allclose(scores, _cosines(vectors[:1], vectors[1:]), atol=1e-6)
    assert scores[0] > scores[1]


def test_bfloat16_close_to_sentence_transformers(minilm_dir: Path, sentence_transformer) -> None:
    """bfloat16 embeddings keep cosine >= 0.999 with sentence-transformers' float32 ones."""
    engine = Engine(model=str(minilm_dir), dtype="bfloat16", device="cpu")
    ours = _vectors(engine.embed(SENTENCES))
    assert _cosines(ours, sentence_transformer.encode(SENTENCES)).min() >= 0.999


async def test_async_engine_batches_concurrent_calls(minilm_dir: Path, minilm_engine: Engine) -> None:
    """Concurrent AsyncEngine.embed calls run in fewer batches than calls and equal the sync engine's embeddings;
    a bad one fails alone."""
    async with AsyncEngine(model=str(minilm_dir), dtype="float32", device="cpu") as engine:
        before = await engine.call(lambda e: (e.stats()["pooling_batches"], e.stats()["pooling_requests"]))
        outputs = await asyncio.gather(*(engine.embed(s) for s in SENTENCES))
        after = await engine.call(lambda e: (e.stats()["pooling_batches"], e.stats()["pooling_requests"]))
        with pytest.raises(RequestRejected):
            await engine.embed("")
        with pytest.raises(UnsupportedTask):
            await anext(engine.generate("hi"))
    assert after[1] - before[1] == len(SENTENCES)
    assert after[0] - before[0] < len(SENTENCES)
    np.testing.assert_allclose(_vectors(outputs), _vectors(minilm_engine.embed(SENTENCES)), atol=2e-6)
