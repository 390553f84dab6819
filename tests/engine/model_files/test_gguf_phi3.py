"""Phi-3 and Phi-4-mini GGUF files (llama.cpp's phi3: fused ``attn_qkv`` and ``ffn_up``, LongRoPE's factors as the
``rope_factors_long`` / ``rope_factors_short`` tensors, the rotated part of a head as ``rope.dimension_count``, the
sliding window, 0 for none) run on the Phi-3 model to the source's logits and greedy tokens (F32) or to its weights
rounded to the file's type (Q8_0)."""

from __future__ import annotations

import copy

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from engine import Engine, SamplingParams, cpu_kernels
from engine.config import EngineConfig
from engine.loader import resolve_model
from engine.model_files.gguf_writer import write_gguf
from engine.worker.model_runner import ModelRunner
from tests.support.gguf_runs import last_logits, load_gguf_weights
from tests.support.hf_reference import hf_greedy, hf_logits

# name -> (tiny_models architecture, overrides): Phi-3 without and with a window, Phi-4-mini's partial rotary
VARIANTS = {"phi3": ("phi3", {}), "phi3_sliding": ("phi3", dict(sliding_window=24)), "phi4_mini": ("phi4_mini", {})}
PROMPT = [5, 9, 77, 120, 3, 200, 31, 64, 500, 17, 2, 900, 13, 14, 15, 16, 40, 41, 42, 43, 600, 601, 602, 603, 604,
          700, 8, 9, 10, 11, 12, 19, 21, 22, 23]  # past the window of 24 and LongRoPE's switch at 32 # fmt: skip


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGED_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def phi(request, tiny_model_factory, small_tokenizer_dir: Path):
    from transformers import AutoModelForCausalLM

    arch, overrides = VARIANTS[request.param]
    source = tiny_model_factory(arch, tokenizer_dir=small_tokenizer_dir, **overrides)
    return source, AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


def _runner(path: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(dtype="float32", num_blocks=64, block_size=4), resolve_model(path))


def test_f32_file_runs_to_the_source_logits_and_greedy_tokens(phi, private_cache: Path, tmp_path: Path) -> None:
    """The file's config is the source's where it matters (LongRoPE's factors and contexts, the rotated part of a
    head, the window); the logits and greedy tokens from the file are transformers' of the source directory."""
    source, hf = phi
    path = write_gguf(source, tmp_path / "phi-F32.gguf", "F32")
    stored = {t.name: t for t in GGUFReader(path).tensors}
    rope = hf.config.rope_parameters
    assert np.array_equal(stored["rope_factors_long.weight"].data, np.float32(rope["long_factor"]))
    assert np.array_equal(stored["rope_factors_short.weight"].data, np.float32(rope["short_factor"]))
    assert "blk.0.attn_qkv.weight" in stored and "blk.0.attn_q.weight" not in stored
    assert stored["blk.0.ffn_up.weight"].data.shape == (2 * hf.config.intermediate_size, hf.config.hidden_size)
    runner = _runner(path)
    config = runner.hf_config
    assert config.model_type == "phi3" and config.sliding_window == hf.config.sliding_window
    for key in ("rope_type", "rope_theta", "original_max_position_embeddings", "long_factor", "short_factor"):
        assert config.rope_parameters[key] == pytest.approx(rope[key]), key
    assert config.rope_parameters.get("partial_rotary_factor", 1.0) == rope.get("partial_rotary_factor", 1.0)
    torch.testing.assert_close(last_logits(runner, PROMPT), hf_logits(hf, PROMPT)[-1], atol=1e-4, rtol=0)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = Engine(str(path), num_blocks=128, block_size=4)
    assert engine.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, PROMPT, 10)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="GGUF types run natively on the CPU kernels")
def test_q8_0_file_runs_in_its_blocks_to_its_rounded_weights_logits(phi, private_cache: Path,
                                                                    tmp_path: Path) -> None:  # fmt: skip
    source, hf = phi
    path = write_gguf(source, tmp_path / "phi-Q8_0.gguf", "Q8_0")
    runner = _runner(path)
    assert runner.weights.modules["Q8_0"] >= 4 * len(runner.model.model.layers) and not runner.weights.dequantized
    hf = copy.deepcopy(hf)  # the module's source model stays as it is
    load_gguf_weights(hf, path)
    got, want = last_logits(runner, PROMPT), hf_logits(hf, PROMPT)[-1]
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 0.008  # measured 0.0053, 0.0051, 0.0037: the inputs' int8 blocks
