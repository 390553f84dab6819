"""Gemma 2, Gemma 3 (text) and Phi-3 / Phi-4-mini end to end: every CPU attention backend and the engine, prefix
caching on and off, give transformers' logits and greedy tokens on prompts and decodes that run past the sliding
window (8 tokens: 2 blocks) and LongRoPE's switch to its long factors (position 32)."""

from __future__ import annotations

import random

import pytest
import torch
from runner_driver import PagedDriver

from engine import Engine, SamplingParams, cpu_kernels
from engine.config import EngineConfig
from engine.layers.norm import GemmaRMSNorm
from engine.worker.model_runner import ModelRunner
from tests.support.hf_reference import hf_greedy, hf_logits

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
    rng = random.Random(1)
    driver = PagedDriver(runner, seed=2)
    expected: list[tuple[str, int, torch.Tensor]] = []

    def record(out: dict[str, torch.Tensor]) -> None:
        expected.extend((req_id, len(driver.tokens[req_id]) - 1, logits) for req_id, logits in out.items())

    driver.add("a", [rng.randrange(3, 1000) for _ in range(29)])
    driver.add("b", [rng.randrange(3, 1000) for _ in range(7)])
    record(driver.step({"a": None, "b": 5}))  # b: a chunk; its rest comes next step
    driver.fork("c", "a", 4, [rng.randrange(3, 1000) for _ in range(3)])  # 16 cached tokens, then 3
    driver.fork("d", "a", 5, [rng.randrange(3, 1000) for _ in range(12)])  # 20 cached, a chunk longer than W
    record(driver.step({"b": None, "c": None, "d": None}))
    for _ in range(10):
        for req_id in "abcd":
            driver.append(req_id, rng.randrange(3, 1000))
        record(driver.step({req_id: 1 for req_id in "abcd"}))
    assert max(len(tokens) for tokens in driver.tokens.values()) > 32
    reference = {req_id: hf_logits(hf, tokens) for req_id, tokens in driver.tokens.items()}
    assert len(expected) == 1 + 3 + 10 * 4
    for req_id, position, logits in expected:
        torch.testing.assert_close(logits, reference[req_id][position], atol=ATOL, rtol=0)


def test_engine_greedy_tokens_match_transformers_with_prefix_caching_on_and_off(family) -> None:
    """Prompts sharing a prefix longer than the window: greedy tokens are transformers', alone or batched, cached
    or not, and every block comes back."""
    _, path, hf = family
    shared = list(range(300, 322))  # 22 tokens: past the window; the decodes run past position 32
    prompts = [shared + [500 + i] * (i + 1) for i in range(3)] + [list(range(700, 709))]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(hf, p, 14) for p in prompts]
    for caching in (True, False):
        engine = Engine(str(path), num_blocks=64, block_size=4, enable_prefix_caching=caching)
        alone = [engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        together = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert alone == expected and together == expected
        assert (engine.stats()["prefix_cache_hits"] > 0) == caching
        engine.kv.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
