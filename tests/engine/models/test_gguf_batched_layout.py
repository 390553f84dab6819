"""A GGUF model's second layout for steps of many rows (``batched_weights_memory``): held within its bound, each
step size multiplied by its layout, the decoder plan's choice the modules', what it holds in ``stats()``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, cpu_kernels
from engine.config import EngineConfig
from engine.core.scheduler_output import ScheduledRequest
from engine.attention.forward_context import ForwardContext, set_forward_context
from engine.layers.batched_weight import BatchedWeight
from engine.layers.ggml_weight import GGMLWeight
from engine.layers.linear import Linear
from engine.loader import resolve_model
from engine.model_files.gguf_writer import write_gguf
from engine.worker.input_batch import prepare_inputs
from engine.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernels")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_factory, small_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer random llama as a Q4_K_M file (Q4_K and Q6_K rows, a Q8_0-free mix of K-quants)."""
    source = tiny_model_factory("llama", tokenizer_dir=small_tokenizer_dir, hidden_size=256, intermediate_size=512)
    return write_gguf(source, tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf", "Q4_K_M")


def _runner(path: Path, **settings) -> ModelRunner:
    return ModelRunner(EngineConfig(num_blocks=16, **settings), resolve_model(path))


def _weights(runner: ModelRunner) -> list:
    return [m.quantized for m in runner.model.modules() if isinstance(m, Linear)]


def test_the_dense_layout_is_held_within_its_memory_bound(tiny_gguf: Path) -> None:
    """By default every block weight keeps a dense layout too, all of them within ``batched_weights_memory``; a
    bound one byte short of what they take keeps the blocks alone, one of exactly that takes them; 0 none."""
    runner = _runner(tiny_gguf)
    batched, weights = runner.weights.batched, _weights(runner)
    assert batched is not None and all(isinstance(w, BatchedWeight) for w in weights)
    assert batched["bytes"] == sum(w.dense.nbytes for w in weights) <= batched["limit"]
    assert sum(batched["modules"].values()) == len(weights)
    assert runner.weights.nbytes == sum(w.blocks.nbytes for w in weights)  # "bytes" stays the blocks'
    for limit, held in ((batched["bytes"] - 1, False), (batched["bytes"], True), (0, False)):
        other = _runner(tiny_gguf, batched_weights_memory=limit)
        assert (other.weights.batched is not None) == held, limit
        kinds = {type(w) for w in _weights(other)}
        assert kinds == ({BatchedWeight} if held else {GGMLWeight}), limit


def test_each_step_size_multiplies_its_layout(tiny_gguf: Path) -> None:
    """Fewer than ``min_rows`` rows give the blocks' products, bit for bit; from ``min_rows``, the dense layout's,
    within 3% of the largest output of the blocks' (both round x to int8 blocks, the dense one rotated)."""
    for w in _weights(_runner(tiny_gguf)):
        for rows in (1, w.min_rows - 1, w.min_rows, 3 * w.min_rows + 1):
            x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(rows))
            want = (w.dense if rows >= w.min_rows else w.blocks).matmul(x, None)
            assert torch.equal(w.matmul(x, None), want)
            blocks = w.blocks.matmul(x, None)
            assert (want - blocks).abs().max() <= 0.03 * blocks.abs().max()


@pytest.mark.parametrize("tokens", [2, 11])
def test_the_decoder_plan_takes_the_modules_layout(tiny_gguf: Path, tokens: int) -> None:
    """A step below ``min_rows`` and one above: the plan's hidden states equal the modules', bit for bit."""
    runner = _runner(tiny_gguf)
    assert runner.decoder_plan is not None and runner.weights.batched["min_rows"] in range(3, 11)
    inputs = prepare_inputs([ScheduledRequest("a", list(range(5, 5 + tokens)), 0, ([1],), True)], runner.block_size,
                            runner.device)
    with torch.inference_mode():
        before = runner.kv_cache.clone()
        planned = runner.decoder_plan.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata[0])
        runner.kv_cache.copy_(before)
        with set_forward_context(ForwardContext(inputs.attn_metadata)):
            eager = runner.model(inputs.input_ids, inputs.positions)
    assert torch.equal(planned, eager)


def test_stats_say_what_is_held(tiny_gguf: Path) -> None:
    """``stats()["weights"]`` names the second layout's formats, bytes, bound and rows, and the products line says
    from how many rows it runs."""
    weights = Engine(str(tiny_gguf), num_blocks=16).stats()["weights"]
    batched = weights["batched"]
    assert set(batched) == {"modules", "bytes", "limit", "min_rows"}
    assert f"from {batched['min_rows']} rows" in weights["products"]
    assert Engine(str(tiny_gguf), num_blocks=16, batched_weights_memory=0).stats()["weights"]["batched"] is None


def test_without_vnni_the_dense_layout_is_bfloat16(tiny_gguf: Path) -> None:
    """Where int8 products would run in plain C, the dense layout is bfloat16 panels throughout."""
    limit = cpu_kernels.library().linear_int8_limit
    limit(cpu_kernels.INT8_LINEAR_PATHS.index("generic"))
    try:
        runner = _runner(tiny_gguf)
    finally:
        limit(len(cpu_kernels.INT8_LINEAR_PATHS) - 1)
    assert runner.weights.batched["modules"] == {"bfloat16": len(_weights(runner))}
    w = runner.model.model.layers[0].mlp.down_proj.quantized
    x = torch.randn(8, w.in_features, generator=torch.Generator().manual_seed(0))
    want = x @ w.blocks.dequantize().T  # the file's weights in float32
    assert (w.matmul(x, None) - want).abs().max() <= 0.02 * want.abs().max()


def test_int8_panels_are_w8a8_of_the_dequantized_blocks(tiny_gguf: Path) -> None:
    """The C conversion (``GGMLWeight.int8_panels``, x16-repacked K-quants among the parts) gives the bits that
    quantizing the dequantized weight in PyTorch gives: ``pack(quantize_symmetric_int8(hadamard_blocks(W)))``."""
    from engine.layers.quantization import hadamard_blocks, pack, quantize_symmetric_int8

    runner = _runner(tiny_gguf, batched_weights_memory=0)
    weights = [w for w in _weights(runner) if w.in_features % 32 == 0]
    assert {"Q4_K", "Q6_K"} <= {part.type_name for w in weights for part in w.parts}
    for w in weights:
        got, want = w.int8_panels(), pack(quantize_symmetric_int8(hadamard_blocks(w.dequantize())), int8_products=True)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)


def test_float_type_weights_keep_their_blocks_alone(tiny_model_factory, small_tokenizer_dir: Path,
                                                    tmp_path: Path) -> None:
    """An F16 file's weights multiply x unrounded: no int8 layout replaces them at any step size."""
    source = tiny_model_factory("llama", tokenizer_dir=small_tokenizer_dir, hidden_size=256, intermediate_size=512)
    runner = _runner(write_gguf(source, tmp_path / "tiny-F16.gguf", "F16"))
    assert runner.weights.batched is None
    assert {type(w) for w in _weights(runner)} == {GGMLWeight}
