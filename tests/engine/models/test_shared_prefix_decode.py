"""Decode batches whose block tables share leading blocks (cascade attention) give transformers' logits."""

from __future__ import annotations

import random

import pytest
import torch
from runner_driver import PagedDriver

from engine.config import EngineConfig
from engine.worker.model_runner import ModelRunner

ATOL = 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forks_decoding_together_match_transformers(tiny_model_factory, arch: str) -> None:
    """Two groups of forks (prefixes of 3 and 1 blocks) and a loner decode 6 steps together; every logit matches HF."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(arch)
    runner = ModelRunner(EngineConfig(dtype="float32", device="cpu", block_size=4, num_blocks=64), path)
    runner.attn_backend.min_shared_keys = 1  # tiny contexts: take the cascade path for any sharing
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(5)
    driver = PagedDriver(runner, seed=6)
    driver.add("a", [rng.randrange(3, 1000) for _ in range(14)])
    driver.add("x", [rng.randrange(3, 1000) for _ in range(9)])
    driver.add("lone", [rng.randrange(3, 1000) for _ in range(6)])
    driver.step({"a": None, "x": None, "lone": None})
    for req_id, parent, blocks, tail in [("b", "a", 3, 2), ("c", "a", 3, 7), ("y", "x", 1, 5)]:
        driver.fork(req_id, parent, blocks, [rng.randrange(3, 1000) for _ in range(tail)])
    driver.step({"b": None, "c": None, "y": None})
    for _ in range(6):
        for req_id in driver.tokens:
            driver.append(req_id, rng.randrange(3, 1000))
        out = driver.step({req_id: 1 for req_id in driver.tokens})
        with torch.inference_mode():
            for req_id, logits in out.items():
                expected = hf(torch.tensor([driver.tokens[req_id]])).logits[0, -1].float()
                torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
