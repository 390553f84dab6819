"""Gemma 2, Gemma 3 (text) and Phi-3 / Phi-4-mini end to end: every CPU attention backend and the engine, prefix
caching on and off, give transformers' logits and greedy tokens on prompts and decodes that run past the sliding
window (8 tokens: 2 blocks) and LongRoPE's switch to its long factors (position 32)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from runner_driver import assert_forks_match

from engine import cpu_kernels
from engine.config import EngineConfig
from engine.layers.norm import GemmaRMSNorm
from engine.worker.model_runner import ModelRunner
from tests.support.hf_reference import assert_engine_greedy_matches, hf_logits

FAMILIES = ["gemma2", "gemma3_text", "phi3", "phi4_mini"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(request.param)
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_layers_carry_the_family_features(family) -> None:
    """The tiny configs exercise what they are for: windows by layer type, soft caps, the query scale, Gemma's
    norms and per-type rope, LongRoPE's two factor sets over a part of each head."""
    arch, path, _ = family
    runner = ModelRunner(EngineConfig(dtype="float32", block_size=4, num_blocks=16), path)
    layers = runner.model.model.layers
    attns = [layer.self_attn.attn for layer in layers]
    if arch == "gemma2":
        assert [a.sliding_window for a in attns] == [8, None]
        assert {a.logit_softcap for a in attns} == {1.0} and runner.model.final_logit_softcap == 5.0
        assert attns[0].scale == pytest.approx(24**-0.5)
    if arch == "gemma3_text":
        assert [a.sliding_window for a in attns] == [8, None, 8] and attns[0].logit_softcap is None
        rotaries = [layer.self_attn.rotary for layer in layers]
        assert rotaries[0] is rotaries[2] and rotaries[0] is not rotaries[1]
        assert isinstance(layers[0].self_attn.q_norm, GemmaRMSNorm)
    if arch.startswith("gemma"):
        assert isinstance(runner.model.model.norm, GemmaRMSNorm) and runner.model.model.embed_scale == 8.0
    else:
        rotary = runner.model.model.rotary
        assert rotary.long_from == 32 and rotary.scaling > 1
        assert rotary.rotary_dim == (12 if arch == "phi4_mini" else 16)
        assert runner.decoder_plan is not None  # Phi runs on the C decoder plan


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(cpu_kernels.library() is None, reason="no C"))]
)
def test_each_backend_matches_transformers_past_the_window(family, backend: str) -> None:
    """Prefills longer than the window, a chunk after a cached prefix, forks and decodes past position 32."""
    _, path, hf = family
    config = EngineConfig(dtype="float32", block_size=4, num_blocks=96, attention_backend=backend, enforce_eager=True)
    runner = ModelRunner(config, path)
    # 16 cached tokens then 3; 20 cached then a chunk longer than the window
    driver = assert_forks_match(
        runner, partial(hf_logits, hf), prompt_len=29, forks=(4, 5), tail_lens=(3, 12), decode_steps=10, atol=ATOL
    )
    assert max(len(tokens) for tokens in driver.tokens.values()) > 32


def test_engine_greedy_tokens_match_transformers_with_prefix_caching_on_and_off(family) -> None:
    """Prompts sharing a prefix longer than the window: greedy tokens are transformers', alone or batched, cached
    or not, and every block comes back."""
    _, path, hf = family
    shared = list(range(300, 322))  # 22 tokens: past the window; the decodes run past position 32
    prompts = [shared + [500 + i] * (i + 1) for i in range(3)] + [list(range(700, 709))]
    assert_engine_greedy_matches(path, hf, prompts, 14)
