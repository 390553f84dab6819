"""Sliding windows end to end, Mistral's (every layer) and Qwen2's (layers past ``max_window_layers``, beside
full-attention layers: two KV cache groups): every attention backend and the engine, prefix caching on and off,
give transformers' logits and greedy tokens on prompts and decodes that run past the window, while the sliding
group holds only its window's blocks."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from runner_driver import assert_forks_match

from engine import Engine, SamplingParams, cpu_kernels
from engine.config import EngineConfig
from engine.core.kv_cache_groups import NULL_BLOCK
from engine.worker.model_runner import ModelRunner
from tests.support.hf_reference import assert_engine_greedy_matches, hf_greedy, hf_logits

ATOL = 1e-4
BS = 4
# tiny_models' archs: the window, each layer's window, each KV cache group's window and each layer's group
ARCHS = {
    "mistral_sliding": (24, [24, 24], (24,), [0, 0]),
    "qwen2_sliding": (10, [None, None, 10, 10, 10, 10], (None, 10, 10), [0, 0, 1, 1, 2, 2]),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, arch):
    return tiny_model_factory(arch)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(cpu_kernels.library() is None, reason="no C"))]
)
def test_each_backend_matches_transformers_past_the_window(model_dir, hf, arch: str, backend: str) -> None:
    """Prefills longer than the window, a chunk after a prefix cached past it, forks and decodes: HF's logits."""
    config = EngineConfig(dtype="float32", block_size=4, num_blocks=192, attention_backend=backend, enforce_eager=True)
    runner = ModelRunner(config, model_dir)
    window, layer_windows, _, _ = ARCHS[arch]
    assert [layer.self_attn.attn.sliding_window for layer in runner.model.model.layers] == layer_windows
    assert runner.max_model_len > window  # the window is applied, not avoided
    # 32 cached tokens then 3; 36 cached then a chunk longer than the window
    assert_forks_match(
        runner, partial(hf_logits, hf), prompt_len=41, forks=(8, 9), tail_lens=(3, 30), decode_steps=12, atol=ATOL
    )


def test_layers_of_one_window_form_a_kv_cache_group(model_dir, arch: str) -> None:
    """Groups by window, full attention first, split to the smallest window's layer count (Qwen2's four sliding
    layers: two groups of two); the i-th layers of all groups share one cache tensor (a block id belongs to one
    group at a time); mixed windows leave the decoder plan to the modules."""
    runner = ModelRunner(EngineConfig(dtype="float32", block_size=BS, num_blocks=32), model_dir)
    _, _, group_windows, layer_groups = ARCHS[arch]
    attns = [layer.self_attn.attn for layer in runner.model.model.layers]
    assert runner.kv_cache_windows == group_windows
    assert [attn.kv_cache_group for attn in attns] == layer_groups
    assert runner.kv_cache.shape[0] == max(layer_groups.count(g) for g in set(layer_groups))
    if len(group_windows) > 1:
        assert attns[0].kv_cache.data_ptr() == attns[2].kv_cache.data_ptr() == attns[4].kv_cache.data_ptr()
        assert runner.decoder_plan is None
    elif cpu_kernels.library() is not None:
        assert runner.decoder_plan is not None


def test_long_prompt_holds_only_the_window_in_the_sliding_group(model_dir, hf, arch: str) -> None:
    """A 150-token prompt in 16-token chunks, then decodes: after every step the full group holds every block
    and the sliding group at most ceil((W - 1 + 16) / bs) + 1 (ceil(W / bs) + 1 once decoding); greedy tokens
    are HF's. A sliding-only model serves it from a cache of 64 slots."""
    window = ARCHS[arch][0]
    sliding_only = arch == "mistral_sliding"
    engine = Engine(str(model_dir), num_blocks=16 if sliding_only else 64, block_size=BS, max_num_batched_tokens=16)
    if sliding_only:
        assert engine.max_num_tokens == engine.max_model_len > 16 * BS
    prompt = [random.Random(5).randrange(3, 1000) for _ in range(150)]
    engine.add_request("long", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    most_held = 0
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        for request in engine.scheduler.running:
            computed = request.num_computed_tokens
            for table, group_window in zip(engine.kv.get_block_ids(request.req_id), engine.kv.sliding_windows):
                held = [block for block in table if block != NULL_BLOCK]
                if group_window is None:
                    assert len(held) == len(table) == -(-computed // BS)
                else:
                    step = 1 if computed > len(prompt) else 16  # the tokens of the step that allocated last
                    assert len(held) <= -(-(window - 1 + step) // BS) + 1
                    most_held = max(most_held, len(held))
        engine.kv.check_integrity()
    assert 0 < most_held < -(-len(prompt) // BS)
    assert outputs[-1].outputs[0].token_ids == hf_greedy(hf, prompt, 6)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_engine_greedy_tokens_match_transformers_with_prefix_caching_on_and_off(model_dir, hf) -> None:
    """Prompts sharing a prefix longer than the window: greedy tokens are HF's, alone or batched, cached or not."""
    shared = list(range(300, 330))  # 30 tokens: past the window
    prompts = [shared + [500 + i] * (i + 1) for i in range(3)] + [list(range(700, 709))]
    assert_engine_greedy_matches(model_dir, hf, prompts, 14)  # decodes run past the window too


def test_preempted_requests_recompute_transformers_tokens(model_dir, hf, arch: str) -> None:
    """Six 40-token prompts in 8-token chunks over a pool too small for all of them: requests are preempted and
    recomputed (their released blocks found again or computed anew), and every greedy output is still HF's; the
    pool ends whole."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(6)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    num_blocks = 20 if arch == "mistral_sliding" else 30  # one request needs 9, or 14 + 2 x 6
    engine = Engine(str(model_dir), num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=8)
    outputs = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert engine.stats()["num_preemptions"] > 0
    assert outputs == [hf_greedy(hf, p, 14) for p in prompts]
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_long_prompt_on_a_small_cache_is_cut_into_chunks_that_fit(model_dir, hf, arch: str) -> None:
    """A 150-token prompt under the default step budget (512 tokens) on a cache far smaller than one step of it:
    the scheduler cuts its chunks to what the groups hold, so it is admitted and finishes with the greedy tokens
    of a big cache (and HF's), and every block comes back."""
    prompt = [random.Random(9).randrange(3, 1000) for _ in range(150)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    big = Engine(str(model_dir), num_blocks=256, block_size=BS)
    expected = big.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert expected == hf_greedy(hf, prompt, 6)
    window = ARCHS[arch][0]
    sliding_groups = sum(w is not None for w in ARCHS[arch][2])
    full_blocks = -(-(len(prompt) + 6) // BS) if None in ARCHS[arch][2] else 0
    small = Engine(str(model_dir), num_blocks=full_blocks + sliding_groups * (-(-window // BS) + 3), block_size=BS)
    assert small.kv.num_blocks_needed(len(prompt), max_chunk=512) > small.kv.num_blocks  # one whole chunk: no room
    output = small.generate([prompt], params, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == expected
    assert small.stats()["num_preemptions"] == 0
    small.kv.check_integrity()
    assert small.kv.num_free_blocks == small.kv.num_blocks
