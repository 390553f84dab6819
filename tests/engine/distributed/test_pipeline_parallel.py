"""Pipeline parallelism over gloo ranks on CPU: two stages (and two stages of two tensor-parallel ranks) give
transformers' greedy tokens exactly in float32, alone and batched with prefix caching on; int8 and GGUF weights
give their one-process tokens; each stage holds its layers only; layer splits that cannot be are refused."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import ParameterError
from engine.models.llama import MissingLayer
from engine.parallel_state import stage_layers

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SHARED = list(range(500, 520))  # a 5-block prefix the prompts below share
PROMPTS = [SHARED + [7, 8, 9], [100, 200, 300], SHARED + list(range(1000, 1013)), [42] * 6]
# gemma3_text's 3 layers split 2 + 1 over sliding and full attention; smollm2's output head is the tied embedding
# (the first stage embeds with it, the last computes the logits with it); mixtral's layers hold experts
MODELS = ("llama", "qwen2", "qwen3", "mixtral", "gemma3_text", "smollm2")
OPTIONS = dict(dtype="float32", device="cpu", block_size=4, num_blocks=96)


def _hf_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
            for p in prompts
        ]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_alone_and_batched(engine: Engine, expected: list[list[int]]) -> None:
    """Each prompt alone, then all in one batch (the shared prefix's blocks cached by then), equal ``expected``;
    every block back in the pool."""
    alone = [_tokens(engine.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    hits = engine.stats()["prefix_cache_hits"]
    batched = _tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert alone == expected
    assert batched == expected
    assert engine.stats()["prefix_cache_hits"] > hits > 0
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("arch", MODELS)
def test_two_stages_give_transformers_greedy_tokens_alone_and_batched(arch, tiny_model_factory) -> None:
    """pp=2: transformers' tokens; the driver (the first stage) holds its layers' weights and attention only,
    the embedding, and no output head."""
    model_dir = tiny_model_factory(arch)
    with Engine(str(model_dir), pipeline_parallel_size=2, **OPTIONS) as engine:
        runner = engine.runner
        layers = stage_layers(runner.text_config.num_hidden_layers, 2)
        held = [i for i, layer in enumerate(runner.model.model.layers) if not isinstance(layer, MissingLayer)]
        assert held == list(layers[0]) and runner.pp.size == 2 and runner.tp.size == 1
        assert not any(".layers.{}.".format(layers[1].start) in name for name, _ in runner.model.named_parameters())
        assert len(runner._attention_layers()) == len(layers[0])
        assert runner.model.lm_head is None and runner.model.model.embed_tokens is not None
        _assert_alone_and_batched(engine, _hf_greedy(model_dir, PROMPTS))
        waits = runner.stage_wait_seconds_per_stage()  # the driver waits for logits, stage 1 for hidden states
        assert len(waits) == 2 and all(wait > 0 for wait in waits)


def test_a_partition_whose_stages_hold_other_windows_gives_transformers_greedy_tokens(tiny_model_factory) -> None:
    """Gemma 3's layers split 1 + 2: the first stage holds a sliding layer only, the last a full and a sliding one;
    the KV cache groups (and so the block tables) are the whole model's on every stage, so that the full layer
    reads every block past the window."""
    model_dir = tiny_model_factory("gemma3_text")
    with Engine(str(model_dir), pipeline_parallel_size=2, pipeline_layer_partition="1,2", **OPTIONS) as engine:
        assert engine.runner.kv_cache_windows == (None, 8, 8)  # as one process groups them
        _assert_alone_and_batched(engine, _hf_greedy(model_dir, PROMPTS))


@pytest.mark.parametrize("arch", [arch for arch in MODELS if arch not in ("mixtral", "gemma3_text")])
def test_two_stages_of_two_tensor_parallel_ranks_give_transformers_greedy_tokens(arch, tiny_model_factory) -> None:
    """pp=2 x tp=2 (four ranks), every family tensor parallelism serves: transformers' tokens; the driver holds
    half of its stage's heads."""
    model_dir = tiny_model_factory(arch)
    with Engine(str(model_dir), pipeline_parallel_size=2, tensor_parallel_size=2, **OPTIONS) as engine:
        assert engine.runner.workers.size == 4 and engine.runner.tp.size == 2
        attn = engine.runner.model.model.layers[0].self_attn
        assert attn.num_heads == engine.runner.text_config.num_attention_heads // 2
        _assert_alone_and_batched(engine, _hf_greedy(model_dir, PROMPTS))
        assert len(engine.runner.stage_wait_seconds_per_stage()) == 2  # ranks 0 and 2, each stage's first


@pytest.mark.parametrize("weights", ["int8", "gguf"])
def test_quantized_weights_over_two_stages_give_their_one_process_tokens(weights, tiny_model_factory, tmp_path) -> None:
    """int8 (the tied output head kept in float on both stages) and a GGUF file's Q8_0 blocks: pp=2's tokens
    equal one process's."""
    from engine import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("quantized weights run on the C kernels")
    model_dir = tiny_model_factory("smollm2")
    model, options = str(model_dir), {**OPTIONS, "quantization": "int8"}
    if weights == "gguf":
        from engine.model_files.gguf_writer import write_gguf

        model, options = str(write_gguf(model_dir, tmp_path / "model-Q8_0.gguf", "Q8_0")), OPTIONS
    with Engine(model, **options) as one:
        expected = _tokens(one.generate(PROMPTS, GREEDY, use_tqdm=False))
    with Engine(model, pipeline_parallel_size=2, **options) as engine:
        assert engine.runner.weights.as_dict()["modules"] != {}
        _assert_alone_and_batched(engine, expected)


def test_layers_split_evenly_or_as_the_partition_says() -> None:
    """An even split gives the first stages the remainder; a partition's counts are taken as given."""
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 2, "1,4") == [range(0, 1), range(1, 5)]
    for partition in ("2,2", "0,5", "1,x", "5"):
        with pytest.raises(ParameterError, match="pipeline_layer_partition") as err:
            stage_layers(5, 2, partition)
        assert err.value.param == "pipeline_layer_partition"
    with pytest.raises(ParameterError, match="pipeline_parallel_size=3 exceeds the model's 2 decoder layers"):
        stage_layers(2, 3)


def test_splits_that_cannot_be_are_refused_before_any_rank_starts(tiny_model_factory) -> None:
    """More stages than layers, a multimodal model, a partition without a pipeline: a ParameterError naming the
    field."""
    with pytest.raises(ParameterError, match="exceeds the model's 2 decoder layers") as err:
        Engine(str(tiny_model_factory("llama")), pipeline_parallel_size=3, num_blocks=16)
    assert err.value.param == "pipeline_parallel_size"
    with pytest.raises(ParameterError, match="not llava") as err:
        Engine(str(tiny_model_factory("llava")), pipeline_parallel_size=2, num_blocks=16)
    assert err.value.param == "pipeline_parallel_size"
    with pytest.raises(ParameterError, match="needs pipeline_parallel_size above 1"):
        EngineConfig(pipeline_layer_partition="1,1")
