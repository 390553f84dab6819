"""DecoderPlan: the decoder layers in one C call give the modules' hidden states and cache, bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_kernels
from engine.config import EngineConfig
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.layers.activation import GeluTanhAndMul
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.attention.forward_context import ForwardContext, set_forward_context
from engine.worker.input_batch import prepare_inputs
from engine.worker.decoder_plan import DecoderPlan
from engine.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="needs the CPU kernels")

# A prefill chunk behind two cached blocks that three decode rows share, and the decode rows: tiles with shared
# keys, rows alone, and new keys read by rows of the same step.
SHARED = [3, 8]
STEP = [
    ScheduledRequest("new", list(range(100, 120)), 32, ([*SHARED, 20, 21],), True),
    *(ScheduledRequest(f"d{i}", [40 + i], 45 + i, ([*SHARED, 10 + i, 0][: 3 + (i > 2)],), True) for i in range(4)),
    ScheduledRequest("alone", [7], 9, ([30],), True),
]


def _both_paths(runner: ModelRunner, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, ...]:
    """(hidden, cache) after the plan's forward, then after the modules' from the same cache."""
    inputs = prepare_inputs(scheduled, runner.block_size, runner.device)
    torch.manual_seed(1)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape).to(runner.kv_cache.dtype))
    before = runner.kv_cache.clone()
    with torch.inference_mode():
        planned = runner.decoder_plan.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata[0])
        planned_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        with set_forward_context(ForwardContext(inputs.attn_metadata)):
            eager = runner.model(inputs.input_ids, inputs.positions)
    return planned, planned_cache, eager, runner.kv_cache


@pytest.mark.parametrize(
    "arch", ["llama", "llama3", "mistral_sliding", "qwen2", "qwen3", "smollm2", "phi3", "phi4_mini"]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_matches_the_modules_bit_for_bit(tiny_model_factory, arch: str, dtype: str) -> None:
    """Every architecture flag (q/k/v bias, q/k head norms, llama3 rotary, a tied head, a sliding window past
    which most rows reach, Phi's fused checkpoint weights and LongRoPE past its switch at 32 over 3/4 of a head) in
    both cache dtypes: the plan's hidden states and every layer's cache equal the modules'."""
    runner = ModelRunner(EngineConfig(dtype=dtype, num_blocks=40), tiny_model_factory(arch))
    assert runner.decoder_plan is not None
    planned, planned_cache, eager, eager_cache = _both_paths(runner, STEP)
    assert torch.equal(planned, eager)
    assert torch.equal(planned_cache, eager_cache)


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_matches_the_modules_with_quantized_weights(tiny_model_factory, quantization: str, dtype: str) -> None:
    runner = ModelRunner(
        EngineConfig(dtype=dtype, num_blocks=40, quantization=quantization), tiny_model_factory("llama")
    )
    assert runner.decoder_plan is not None
    planned, planned_cache, eager, eager_cache = _both_paths(runner, STEP)
    assert torch.equal(planned, eager) and torch.equal(planned_cache, eager_cache)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_matches_the_modules_on_the_bundled_gguf_blocks(bundled_gguf_dir, dtype: str) -> None:
    """The bundled model served in its GGUF file's own blocks (Q4_1 and Q8_0), 30 layers."""
    runner = ModelRunner(EngineConfig(dtype=dtype, num_blocks=40), bundled_gguf_dir)
    assert runner.decoder_plan is not None and {"Q4_1", "Q8_0"} <= set(runner.weights.modules)
    planned, planned_cache, eager, eager_cache = _both_paths(runner, STEP)
    assert torch.equal(planned, eager) and torch.equal(planned_cache, eager_cache)


def test_layers_of_different_windows_or_soft_capped_take_the_modules(tiny_model_factory) -> None:
    """One step's attention tiles serve every layer in the plan: layers that differ in their window, or soft-cap
    their scores, are left to the modules."""
    runner = ModelRunner(EngineConfig(num_blocks=40), tiny_model_factory("mistral_sliding"))
    assert runner.decoder_plan is not None
    first = runner.model.model.layers[0].self_attn.attn
    first.sliding_window = None
    assert DecoderPlan.build(runner.model, runner.attn_backend, runner.dtype) is None
    first.sliding_window, first.logit_softcap = 24, 30.0
    assert DecoderPlan.build(runner.model, runner.attn_backend, runner.dtype) is None


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_gemma_takes_the_modules(tiny_model_factory, arch: str) -> None:
    runner = ModelRunner(EngineConfig(num_blocks=40), tiny_model_factory(arch))
    assert runner.decoder_plan is None and runner.layers == "modules"


@pytest.mark.parametrize("change", ["gelu", "norm", "sandwich", "rotary", "scale"])
def test_what_decoder_c_does_not_compute_takes_the_modules(tiny_model_factory, change: str) -> None:
    """Each of Gemma's differences alone leaves a Llama model to the modules: a gelu MLP, a norm scaling by
    1 + weight, norms of each block's output, one layer's own rope, one layer's own query scale."""
    runner = ModelRunner(EngineConfig(num_blocks=40), tiny_model_factory("llama"))
    assert runner.decoder_plan is not None
    layer = runner.model.model.layers[1]
    if change == "gelu":
        layer.mlp.act = GeluTanhAndMul()
    elif change == "norm":
        layer.input_layernorm.__class__ = GemmaRMSNorm
    elif change == "sandwich":
        layer.sandwich_norms = True
    elif change == "rotary":
        rotary = layer.self_attn.rotary
        layer.self_attn.rotary = RotaryEmbedding(rotary.head_dim, rotary.inv_freq / 2, rotary.max_position)
        layer.self_attn.rotary.materialize(runner.device, runner.dtype)
    else:
        layer.self_attn.attn.scale /= 2
    assert DecoderPlan.build(runner.model, runner.attn_backend, runner.dtype) is None


def test_enforce_eager_runs_the_modules_to_the_same_logits(tiny_model_factory) -> None:
    path = tiny_model_factory("llama")
    eager = ModelRunner(EngineConfig(num_blocks=40, enforce_eager=True), path)
    planned = ModelRunner(EngineConfig(num_blocks=40), path)
    assert eager.decoder_plan is None and planned.decoder_plan is not None
    step = SchedulerOutput(scheduled=STEP)
    assert torch.equal(planned.execute_model(step), eager.execute_model(step))


@pytest.mark.parametrize(
    "scheduled, error, match",
    [
        ([ScheduledRequest("a", [1, 2], 0, ([40],), True)], IndexError, "slot of slot_mapping is outside the cache's 640"),
        ([ScheduledRequest("a", [1], 2048, ([0] * 129,), True)], IndexError, "outside the rotary table's 2048 positions"),
    ],
)
def test_a_bad_step_raises_the_modules_error(tiny_model_factory, scheduled, error, match) -> None:
    """A block outside the cache or a position past the rotary table: the error the modules' kernels raise."""
    path = tiny_model_factory("llama")
    step = SchedulerOutput(scheduled=scheduled)
    for config in (EngineConfig(num_blocks=40), EngineConfig(num_blocks=40, enforce_eager=True)):
        with pytest.raises(error, match=match):
            ModelRunner(config, path).execute_model(step)
