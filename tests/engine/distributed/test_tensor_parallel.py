"""Tensor parallelism over two gloo ranks on CPU: transformers' greedy tokens exactly, in float32, alone and batched,
with prefix caching on; KV heads fewer than the ranks are replicated; models that do not split are refused."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import ParameterError
from engine.parallel_state import TensorParallel, check_tensor_parallel, shard_units

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SHARED = list(range(500, 520))  # a 5-block prefix the prompts below share
PROMPTS = [SHARED + [7, 8, 9], [100, 200, 300], SHARED + list(range(1000, 1013)), [42] * 6]
# llama and qwen2 split their 4 heads and 2 KV heads; smollm2_kv1 replicates its one KV head on both ranks, and
# its output head is the (vocabulary-split) embedding
MODELS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "smollm2_kv1": ("smollm2", {"num_key_value_heads": 1})}


def _hf_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
            for p in prompts
        ]


@pytest.fixture(scope="module", params=sorted(MODELS))
def tp_engine(request, tiny_model_factory):
    arch, overrides = MODELS[request.param]
    model_dir = tiny_model_factory(arch, **overrides)
    engine = Engine(str(model_dir), tensor_parallel_size=2, dtype="float32", device="cpu", block_size=4, num_blocks=96)
    yield engine, _hf_greedy(model_dir, PROMPTS)
    engine.runner.workers.close()


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_two_ranks_give_transformers_greedy_tokens_alone_and_batched(tp_engine) -> None:
    """Each prompt alone, then all in one batch (the shared prefix's blocks cached by then), equal transformers'."""
    engine, expected = tp_engine
    assert engine.runner.tp.size == 2 and engine.runner.layers == "modules"
    alone = [_tokens(engine.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    hits = engine.stats()["prefix_cache_hits"]
    batched = _tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert alone == expected
    assert batched == expected
    assert engine.stats()["prefix_cache_hits"] > hits > 0
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_each_rank_holds_half_the_heads(tp_engine) -> None:
    """Rank 0's attention holds half the query heads, and its KV cache its KV heads only (one replicated head
    where the model has fewer KV heads than ranks)."""
    engine, _ = tp_engine
    config = engine.runner.hf_config
    attn = engine.runner.model.model.layers[0].self_attn
    assert attn.num_heads == config.num_attention_heads // 2
    assert attn.num_kv_heads == max(1, config.num_key_value_heads // 2)
    assert engine.runner.kv_cache.shape[-2] == attn.num_kv_heads
    assert engine.runner.all_reduce_seconds > 0


def test_shard_units_split_evenly_or_replicate() -> None:
    """Heads split evenly; fewer units than ranks are replicated when they divide the ranks; else refused."""
    assert [shard_units(8, TensorParallel(r, 4), "heads") for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [shard_units(2, TensorParallel(r, 4), "heads") for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ParameterError, match="splits neither the model's 3 KV heads") as err:
        shard_units(3, TensorParallel(0, 2), "KV heads")
    assert err.value.param == "tensor_parallel_size"


def test_models_that_do_not_split_are_refused_before_any_rank_starts(tiny_model_factory) -> None:
    """Heads that do not divide by the ranks, or a mixture of experts, raise ParameterError naming the field."""
    with pytest.raises(ParameterError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads") as e:
        Engine(str(tiny_model_factory("llama")), tensor_parallel_size=3, num_blocks=16)
    assert e.value.param == "tensor_parallel_size"
    from transformers import AutoConfig

    moe = AutoConfig.from_pretrained(tiny_model_factory("mixtral"))
    with pytest.raises(ParameterError, match="not mixtral"):
        check_tensor_parallel(moe, 2)
    with pytest.raises(ParameterError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
