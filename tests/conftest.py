"""Shared fixtures: tiny random-weight models of each architecture, and the bundled model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Small enough to run in milliseconds, big enough to exercise GQA, several layers and blocks.
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
)

TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=16)),
    "smollm2": ("LlamaConfig", dict(tie_word_embeddings=True)),
}


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
    """The bundled SmolLM2-135M-Instruct as a Hugging Face directory (converted once)."""
    from engine.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_model_factory(
    tmp_path_factory: pytest.TempPathFactory, bundled_model_dir: Path
) -> Callable[..., Path]:
    """``factory(arch="llama", **config_overrides) -> Path``: a tiny random-weight HF model directory.

    Weights are seeded, so the same arguments give the same model; the tokenizer is the
    bundled model's, so prompts and detokenization are real.
    """
    import torch
    import transformers

    built: dict[tuple, Path] = {}

    def factory(arch: str = "llama", **overrides: object) -> Path:
        key = (arch, tuple(sorted(overrides.items(), key=lambda kv: kv[0])))
        if key in built:
            return built[key]
        config_cls, arch_kwargs = TINY_ARCHS[arch]
        tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_dir)
        config = getattr(transformers, config_cls)(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **{**_TINY, **arch_kwargs, **overrides},
        )
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        out = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (bundled_model_dir / name).exists():
                shutil.copy(bundled_model_dir / name, out / name)
        built[key] = out
        return out

    return factory
