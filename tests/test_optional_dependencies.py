"""The engine, the SDK and the server run without the optional extras: Triton, LangChain, LlamaIndex, Ray.

Each check runs in a fresh interpreter whose ``sys.meta_path`` refuses those packages, as if
they were not installed, and records every attempt to import one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tests.support.fresh_interpreter import run_fresh

_BLOCK_OPTIONAL = """
import importlib.abc
import json
import sys

BLOCKED = {"triton", "langchain_core", "llama_index", "ray"}
attempts = []


class BlockOptional(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, BlockOptional())
"""


def _run(body: str, *args: str) -> dict:
    """Run ``body`` after the blocker in a fresh interpreter at the repository root; its last stdout line is JSON."""
    return run_fresh(_BLOCK_OPTIONAL + body, *args)


def test_core_packages_import_without_extras() -> None:
    """engine, the SDK client and the OpenAI server import without the extras and never ask for them."""
    result = _run(
        """
import engine, sdk, sdk.client, integrations.cli, integrations.openai_server.app

core_attempts = list(attempts)
errors = {}
for adapter in ("sdk.integrations.langchain", "sdk.integrations.llamaindex"):
    try:
        __import__(adapter)
    except ImportError as exc:
        errors[adapter] = str(exc)
print(json.dumps({"attempts": core_attempts, "errors": errors}))
"""
    )
    assert result["attempts"] == []
    assert "pip install 'paged[langchain]'" in result["errors"]["sdk.integrations.langchain"]
    assert "pip install 'paged[llamaindex]'" in result["errors"]["sdk.integrations.llamaindex"]


def test_engine_runs_on_cpu_without_extras(tiny_model_factory: Callable[..., Path]) -> None:
    """An Engine generates on CPU with each CPU backend without Triton or the frameworks; the Triton one names its extra."""
    result = _run(
        """
from engine import Engine, SamplingParams, cpu_kernels

tokens = {}
for backend in ("auto", "torch", "cpu") if cpu_kernels.library() is not None else ("auto", "torch"):
    engine = Engine(sys.argv[1], attention_backend=backend, device="cpu", num_blocks=16, block_size=4)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    tokens[backend] = out[0].outputs[0].token_ids
cpu_attempts = list(attempts)

import torch
from engine.attention import get_attention_backend

try:  # the selector checks only the device's type, so a CUDA device object reaches the import
    get_attention_backend("triton", torch.device("cuda"), torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=16,
                          block_size=16)
    triton_error = None
except ModuleNotFoundError as exc:
    triton_error = str(exc)
print(json.dumps({"attempts": cpu_attempts, "tokens": tokens, "triton_error": triton_error}))
""",
        str(tiny_model_factory("llama")),
    )
    assert result["attempts"] == []
    assert all(len(t) == 3 for t in result["tokens"].values())
    assert "pip install 'paged[gpu]'" in result["triton_error"]
