"""Decoder embedding models (Qwen3-Embedding's recipe: last-token pooling, normalized) against transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from engine import Engine, UnsupportedTask

TEXTS = ["short", "a somewhat longer sentence about paged attention and its blocks", "x y " * 40, "mid length text here"]


def _with_sentence_transformers_files(model_dir: Path, out: Path) -> Path:
    shutil.copytree(model_dir, out)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    return out


def _reference(model_dir: Path, texts: list[str]) -> np.ndarray:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for text in texts:  # one at a time: no padding question for the reference
        ids = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            rows.append(model(**ids).last_hidden_state[0, -1])
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_decoder_embeddings_equal_transformers(tiny_model_factory, tmp_path: Path, arch: str) -> None:
    """A Qwen3 with sentence-transformers' lasttoken files, and a Qwen2 under runner="pooling", embed as transformers'
    last hidden state of the last token, normalized; the packed batch equals one-by-one."""
    base = tiny_model_factory(arch)
    if arch == "qwen3":
        model_dir = _with_sentence_transformers_files(base, tmp_path / "st")
        engine = Engine(model=str(model_dir), device="cpu", dtype="float32")
    else:
        model_dir = base
        engine = Engine(model=str(model_dir), device="cpu", dtype="float32", runner="pooling")
    assert engine.task == "embed" and engine.runner.num_blocks == 1
    ours = np.array([o.outputs.embedding for o in engine.embed(TEXTS)])
    np.testing.assert_allclose(ours, _reference(model_dir, TEXTS), atol=3e-5)
    with pytest.raises(UnsupportedTask):
        engine.generate(["hi"])


def test_qwen3_reranker_yes_no_scores(tiny_model_factory) -> None:
    """A Qwen3 under convert="classify" scores a (query, document) pair as Qwen3-Reranker's recipe: the sigmoid of
    logit("yes") - logit("no") at the pair's last token (transformers' causal LM); batched == alone."""
    model_dir = tiny_model_factory("qwen3")
    engine = Engine(model=str(model_dir), device="cpu", dtype="float32", runner="pooling", convert="classify")
    assert engine.task == "classify"
    query = "<Instruct>: Given a question, find passages that answer it\n<Query>: what is paged attention\n"
    docs = [f"<Document>: {text}<|im_end|>\n<|im_start|>assistant\n" for text in TEXTS]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    expected = []
    for doc in docs:
        ids = tokenizer(query, doc, return_tensors="pt")
        with torch.no_grad():
            logits = model(**ids).logits[0, -1]
        expected.append(torch.sigmoid(logits[yes] - logits[no]).item())
    scores = [s.outputs.score for s in engine.score(query, docs)]
    np.testing.assert_allclose(scores, expected, atol=2e-5)
    np.testing.assert_allclose([engine.score(query, d)[0].outputs.score for d in docs], scores, atol=1e-6)
