"""Tiny random BERT and XLM-RoBERTa embedders and cross-encoders against transformers' own forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from engine import Engine, PoolingParams

TEXTS = ["short", "a somewhat longer sentence about paged attention", "x " * 60, "mixed lengths in one batch"]


def _reference_embeddings(model_dir, texts: list[str], pooling: str) -> np.ndarray:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=126, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    if pooling == "cls":
        pooled = hidden[:, 0]
    elif pooling == "max":  # sentence-transformers' max: padding set to -1e9, the max over the sequence
        pooled = hidden.masked_fill(mask == 0, -1e9).max(1).values
    else:
        pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
def test_encoder_embeddings_equal_transformers(tiny_encoder_factory, model_type: str, pooling: str) -> None:
    """Packed, unpadded batches give transformers' padded-batch embeddings, pooled as the files say."""
    model_dir = tiny_encoder_factory(model_type, st_pooling=pooling)
    engine = Engine(model=str(model_dir), device="cpu", dtype="float32")
    ours = np.array([o.outputs.embedding for o in engine.embed(TEXTS)])
    np.testing.assert_allclose(ours, _reference_embeddings(model_dir, TEXTS, pooling), atol=2e-5)


def test_encoder_without_sentence_transformers_files_pools_cls(tiny_encoder_factory) -> None:
    """A bare BertModel embeds by its normalized CLS state (vLLM's default for encoders)."""
    model_dir = tiny_encoder_factory("bert")
    engine = Engine(model=str(model_dir), device="cpu", dtype="float32")
    ours = np.array([o.outputs.embedding for o in engine.embed(TEXTS)])
    np.testing.assert_allclose(ours, _reference_embeddings(model_dir, TEXTS, "cls"), atol=2e-5)


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_equal_transformers_logits(tiny_encoder_factory, model_type: str) -> None:
    """score() of (query, document) pairs equals the sigmoid of transformers' sequence-classification logit
    (use_activation=False: the logit), segment ids included; batched == alone."""
    model_dir = tiny_encoder_factory(model_type, classify=True)
    engine = Engine(model=str(model_dir), device="cpu", dtype="float32")
    assert engine.task == "classify"
    query, docs = "what is paged attention", TEXTS
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tokenizer([query] * len(docs), docs, padding=True, truncation=True, max_length=126, return_tensors="pt")
    if model_type == "xlm-roberta":  # one segment type: MiniLM's tokenizer marks the second segment 1
        batch["token_type_ids"].zero_()
    with torch.no_grad():
        logits = model(**batch).logits[:, 0].numpy()
    raw = [s.outputs.score for s in engine.score(query, docs, PoolingParams(use_activation=False))]
    np.testing.assert_allclose(raw, logits, atol=2e-5)
    scores = [s.outputs.score for s in engine.score(query, docs)]
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logits)), atol=1e-5)
    alone = [engine.score(query, d)[0].outputs.score for d in docs]
    np.testing.assert_allclose(alone, scores, atol=1e-6)
    with pytest.raises(Exception, match="is a cross-encoder: it cannot embed, only score"):
        engine.embed("x")
