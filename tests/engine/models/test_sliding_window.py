"""Mistral's sliding window end to end: every attention backend and the engine, prefix caching on and off,
give transformers' logits and greedy tokens on prompts and decodes that run past the window."""

from __future__ import annotations

import random

import pytest
import torch
from runner_driver import PagedDriver

from engine import Engine, SamplingParams, cpu_kernels
from engine.config import EngineConfig
from engine.worker.model_runner import ModelRunner

WINDOW = 24  # tiny_models' mistral_sliding: 6 blocks of 4
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("mistral_sliding")


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(_hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(cpu_kernels.library() is None, reason="no C"))]
)
def test_each_backend_matches_transformers_past_the_window(model_dir, hf, backend: str) -> None:
    """Prefills longer than the window, a chunk after a prefix cached past it, forks and decodes: HF's logits."""
    config = EngineConfig(dtype="float32", block_size=4, num_blocks=96, attention_backend=backend, enforce_eager=True)
    runner = ModelRunner(config, model_dir)
    assert runner.model.model.layers[0].self_attn.attn.sliding_window == WINDOW
    assert runner.max_model_len > WINDOW  # the window is applied, not avoided
    rng = random.Random(1)
    driver = PagedDriver(runner, seed=2)
    expected: list[tuple[str, int, torch.Tensor]] = []

    def record(out: dict[str, torch.Tensor]) -> None:
        expected.extend((req_id, len(driver.tokens[req_id]) - 1, logits) for req_id, logits in out.items())

    driver.add("a", [rng.randrange(3, 1000) for _ in range(41)])
    driver.add("b", [rng.randrange(3, 1000) for _ in range(7)])
    record(driver.step({"a": None, "b": 5}))  # b: a chunk; its rest comes next step
    driver.fork("c", "a", 8, [rng.randrange(3, 1000) for _ in range(3)])  # 32 cached tokens, then 3
    driver.fork("d", "a", 9, [rng.randrange(3, 1000) for _ in range(30)])  # 36 cached, a chunk longer than W
    record(driver.step({"b": None, "c": None, "d": None}))
    for _ in range(12):
        for req_id in "abcd":
            driver.append(req_id, rng.randrange(3, 1000))
        record(driver.step({req_id: 1 for req_id in "abcd"}))
    reference = {req_id: _hf_logits(hf, tokens) for req_id, tokens in driver.tokens.items()}
    assert len(expected) == 1 + 3 + 12 * 4
    for req_id, position, logits in expected:
        torch.testing.assert_close(logits, reference[req_id][position], atol=ATOL, rtol=0)


def test_engine_greedy_tokens_match_transformers_with_prefix_caching_on_and_off(model_dir, hf) -> None:
    """Prompts sharing a prefix longer than the window: greedy tokens are HF's, alone or batched, cached or not."""
    shared = list(range(300, 330))  # 30 tokens: past the window
    prompts = [shared + [500 + i] * (i + 1) for i in range(3)] + [list(range(700, 709))]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)  # decodes run past the window too
    expected = [_hf_greedy(hf, p, 14) for p in prompts]
    for caching in (True, False):
        engine = Engine(str(model_dir), num_blocks=64, block_size=4, enable_prefix_caching=caching)
        alone = [engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        together = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert alone == expected and together == expected
        assert (engine.stats()["prefix_cache_hits"] > 0) == caching
        engine.kv.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
