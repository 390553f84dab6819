"""Our model code over the paged cache gives transformers' logits for every supported architecture."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import TINY_ARCHS
from runner_driver import PagedDriver

from engine.config import EngineConfig
from engine.layers.linear import Linear
from engine.worker.model_runner import ModelRunner, resolve_dtypes
from tests.support.bf16_paths import PATHS as BF16_PATHS
from tests.support.bf16_paths import bf16_path
from tests.support.hf_reference import hf_logits

ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def models(request, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(request.param)
    runner = ModelRunner(EngineConfig(dtype="float32", device="cpu", block_size=4, num_blocks=192), path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return runner, hf


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


def test_mixed_batch_prefill_prefix_and_decode_match_transformers(models) -> None:
    """Prefill, prefill over cached or same-step-written prefix blocks, chunked prefill and 20 decode steps match HF."""
    runner, hf = models
    rng = random.Random(1)
    driver = PagedDriver(runner, seed=2)
    expected: list[tuple[str, int, torch.Tensor]] = []  # req_id, position, our logits

    def record(out: dict[str, torch.Tensor]) -> None:
        for req_id, logits in out.items():
            expected.append((req_id, len(driver.tokens[req_id]) - 1, logits))

    # Step 1: three plain prefills of different lengths, and "d" sharing "a"'s first 3 blocks
    # in the same step (it reads K/V that "a" writes in this very forward pass).
    driver.add("a", _prompt(rng, 37))
    driver.add("b", _prompt(rng, 5))
    driver.add("c", _prompt(rng, 1))
    record(driver.step({"a": None, "b": None, "c": None}))
    driver.fork("d", "a", 3, _prompt(rng, 9))
    # Step 2: "e" is a prefill over a prefix cached in step 1 (only its tail is computed),
    # next to the decodes of a, b, c and a chunked prefill of "f".
    driver.fork("e", "a", 5, _prompt(rng, 6))
    driver.add("f", _prompt(rng, 23))
    for req_id in "abc":
        driver.append(req_id, rng.randrange(3, 49152))
    record(driver.step({"a": 1, "b": 1, "c": 1, "d": None, "e": None, "f": 10}))
    record(driver.step({"f": None}))
    for _ in range(20):
        for req_id in "abcdef":
            driver.append(req_id, rng.randrange(3, 49152))
        record(driver.step({req_id: 1 for req_id in "abcdef"}))

    reference = {req_id: hf_logits(hf, tokens) for req_id, tokens in driver.tokens.items()}
    assert len(expected) == 3 + 5 + 1 + 20 * 6
    for req_id, position, logits in expected:
        torch.testing.assert_close(logits, reference[req_id][position], atol=ATOL, rtol=0)


def test_same_step_shared_prefix_matches_transformers(models) -> None:
    """A request reading prefix blocks written by another request in the same step gets HF's logits."""
    runner, hf = models
    rng = random.Random(3)
    driver = PagedDriver(runner, seed=4)
    driver.add("a", _prompt(rng, 18))
    # allocate a's blocks up front, in every KV cache group
    driver.block_ids["a"] = [[driver.free_blocks.pop() for _ in range(5)] for _ in range(driver.num_groups)]
    driver.fork("d", "a", 4, _prompt(rng, 3))
    driver.num_computed["d"] = 16  # d's prefix is a's first 16 tokens, written by a in this step
    out = driver.step({"d": None, "a": None})  # d before a: a's K/V must still be stored first
    torch.testing.assert_close(out["d"], hf_logits(hf, driver.tokens["d"])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["a"], hf_logits(hf, driver.tokens["a"])[-1], atol=ATOL, rtol=0)


def test_bfloat16_runner_tracks_float32_reference(tiny_model_factory) -> None:
    """In bfloat16 the runner's logits stay within bf16 rounding of HF's float32 logits, decode included."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("qwen2")
    runner = ModelRunner(EngineConfig(dtype="bfloat16", device="cpu", block_size=4, num_blocks=32), path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(7)
    driver = PagedDriver(runner, seed=8)
    driver.add("a", _prompt(rng, 13))
    driver.add("b", _prompt(rng, 6))
    got = driver.step({"a": None, "b": None})
    for _ in range(3):
        for req_id in "ab":
            driver.append(req_id, rng.randrange(3, 49152))
        got = driver.step({"a": 1, "b": 1})
    for req_id in "ab":
        expected = hf_logits(hf, driver.tokens[req_id])[-1]
        assert got[req_id].dtype == torch.float32
        torch.testing.assert_close(got[req_id], expected, atol=1e-2, rtol=0)


@pytest.mark.skipif(
    resolve_dtypes("bfloat16", torch.device("cpu")) != (torch.float32, torch.bfloat16),
    reason="without the C kernels bfloat16 computes in bfloat16",
)
@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize("arch", ["smollm2", "qwen2"])  # tied embeddings; biases
def test_bfloat16_weights_and_cache_compute_in_float32(tiny_model_factory, arch: str, path: str) -> None:
    """bfloat16 weights and KV cache, each linear path this CPU has: the logits are HF's float32 ones of the same
    checkpoint with its matrices rounded to bfloat16 (and each linear's input too, on the paths that compute with
    bfloat16 products), up to the K/V rounding (about 1e-3 here), for prefill, a chunk over a prefix and decode."""
    from transformers import AutoModelForCausalLM

    with bf16_path(path):
        _check_bfloat16_weights(AutoModelForCausalLM, tiny_model_factory(arch), round_inputs=path != "widened")


def _check_bfloat16_weights(auto_model, model_path, round_inputs: bool) -> None:
    runner = ModelRunner(EngineConfig(dtype="bfloat16", device="cpu", block_size=4, num_blocks=48), model_path)
    assert runner.dtype == torch.float32 and runner.kv_cache.dtype == torch.bfloat16
    packed = [m.packed for m in runner.model.modules() if isinstance(m, Linear)]
    assert packed and all(p is not None and p.dtype == torch.bfloat16 for p in packed)
    hf = auto_model.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 2:
                param.copy_(param.bfloat16())
    if round_inputs:
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    rng = random.Random(11)
    driver = PagedDriver(runner, seed=12)
    expected: list[tuple[str, int, torch.Tensor]] = []

    def record(out: dict[str, torch.Tensor]) -> None:
        for req_id, logits in out.items():
            expected.append((req_id, len(driver.tokens[req_id]) - 1, logits))

    driver.add("a", _prompt(rng, 21))
    driver.add("b", _prompt(rng, 3))
    record(driver.step({"a": None, "b": None}))
    driver.fork("c", "a", 4, _prompt(rng, 7))  # its tail is computed over a's cached blocks
    for step in range(4):
        for req_id in "ab":
            driver.append(req_id, rng.randrange(3, 49152))
        record(driver.step({"a": 1, "b": 1} | ({"c": None} if step == 0 else {})))
    assert len(expected) == 2 + 4 * 2 + 1
    reference = {req_id: hf_logits(hf, tokens) for req_id, tokens in driver.tokens.items()}
    for req_id, position, logits in expected:
        torch.testing.assert_close(logits, reference[req_id][position], atol=5e-3, rtol=0)
