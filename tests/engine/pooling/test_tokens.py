"""Pooling intake: long pages cut before the tokenizer sees them whole, with the ids of whole tokenization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.errors import ModelLoadError
from engine.pooling.model_config import model_pooling
from engine.pooling.params import PoolingParams
from engine.pooling.tokens import PoolingTokenizer


class _Spy:
    """A tokenizer that records the longest text it was handed."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def __call__(self, texts, pairs=None, **kwargs):
        self.longest = max([self.longest, *map(len, texts), *map(len, pairs or [])])
        return self.tokenizer(texts, pairs, **kwargs)


def test_long_page_is_cut_before_tokenizing(minilm_dir: Path) -> None:
    """A 1 MB page reaches the tokenizer as a few KB and gives the ids whole tokenization with truncation gives;
    a text the cut would shorten below the limit is tokenized whole."""
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    _, config = model_pooling(minilm_dir)
    spy = _Spy(tokenizer)
    intake = PoolingTokenizer(spy, config)
    page = " ".join(f"token{i % 97} is, here; a word" for i in range(40_000))
    dense = "x" * 5000 + " tail"  # one giant word: the cut leaves too little, so the whole text is read
    inputs = intake.embed_inputs([page, dense], PoolingParams())
    assert spy.longest < len(page) // 100
    for text, item in zip([page, dense], inputs):
        assert item.token_ids == tokenizer(text, truncation=True, max_length=256)["input_ids"]


def test_pairs_are_cut_longest_first(minilm_dir: Path) -> None:
    """A (query, long document) pair keeps the query and the document's first tokens, as the tokenizer cuts a pair."""
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    _, config = model_pooling(minilm_dir)
    doc = "retrieval augmented generation " * 500
    [item] = PoolingTokenizer(tokenizer, config).pair_inputs("what is rag", [doc], PoolingParams())
    expected = tokenizer("what is rag", doc, truncation="longest_first", max_length=256)
    assert item.token_ids == expected["input_ids"] and item.token_type_ids == expected["token_type_ids"]


def test_model_task_from_files(minilm_dir: Path, tmp_path: Path) -> None:
    """A sentence-transformers model embeds; a *ForSequenceClassification classifies; runner/convert override;
    an encoder told to generate is refused by name."""
    assert model_pooling(minilm_dir)[0] == "embed"
    assert model_pooling(minilm_dir, "pooling", "classify")[0] == "classify"
    with pytest.raises(ModelLoadError, match="cannot generate"):
        model_pooling(minilm_dir, "generate")
    cross = tmp_path / "cross"
    cross.mkdir()
    config = json.loads((minilm_dir / "config.json").read_text())
    config["architectures"] = ["BertForSequenceClassification"]
    (cross / "config.json").write_text(json.dumps(config))
    shutil.copy(minilm_dir / "tokenizer_config.json", cross)
    task, pooling = model_pooling(cross)
    assert task == "classify" and pooling is not None
    assert (pooling.pooling, pooling.normalize, pooling.max_length) == ("cls", True, 512)
