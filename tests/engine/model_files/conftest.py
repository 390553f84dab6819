"""Fixtures for model files: a small-vocabulary tokenizer, so GGUF files of tiny models parse in milliseconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

SMALL_VOCAB = 1024


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, bundled_model_dir: Path) -> Path:
    """The bundled tokenizer cut to its first ``SMALL_VOCAB`` ids and the merges among them (a real
    byte-level BPE, its special tokens and chat template kept)."""
    out = tmp_path_factory.mktemp("small-tokenizer")
    tokenizer = json.loads((bundled_model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = tokenizer["model"]
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < SMALL_VOCAB}
    kept = set(model["vocab"])
    model["merges"] = [m for m in model["merges"] if m[0] in kept and m[1] in kept and m[0] + m[1] in kept]
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < SMALL_VOCAB]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled_model_dir / name, out / name)
    return out
