"""Each rank's shard of a checkpoint, in every weight format: float, int8 blocks, a GGUF file's own blocks. The
ranks' shards laid side by side are the one-rank weights exactly; a shard that would cut a GGUF block is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import cpu_kernels
from engine.layers.linear import Linear, MergedLinear
from engine.layers.parallel_linear import RowParallelLinear
from engine.model_files.checkpoint import Checkpoint, GGUFCheckpoint, SafetensorsCheckpoint
from engine.model_files.gguf import GGUFFile
from engine.model_files.gguf_writer import write_gguf
from engine.models.llama import LlamaForCausalLM
from engine.parallel_state import SINGLE, TensorParallel, tensor_parallel
from engine.worker.weight_formats import LoadPlan, load_weights

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="the quantized formats run on the C kernels")

WIDE = dict(hidden_size=256, intermediate_size=512)  # rows of 256: the K-quants' blocks


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, small_tokenizer_dir: Path) -> Path:
    return tiny_model_factory("llama", tokenizer_dir=small_tokenizer_dir, **WIDE)


def _load(model_dir: Path, checkpoint: Checkpoint, tp: TensorParallel, quantization: str | None) -> dict[str, Linear]:
    from transformers import AutoConfig

    with torch.device("meta"), tensor_parallel(tp):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(model_dir))
    plan = LoadPlan(quantization, torch.float32, torch.float32, torch.device("cpu"), packed=True)
    load_weights(model, checkpoint, plan)
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def _dense(module: Linear) -> torch.Tensor:  # [out, in] float32, whatever the format
    rows = torch.arange(module.out_features)
    if module.quantized is not None:
        return module.quantized.rows(rows)
    return cpu_kernels.packed_rows(module.packed, rows, module.in_features).float()


def _joined(shards: list[Linear]) -> torch.Tensor:
    """The ranks' weights laid back side by side: input columns for a row-parallel layer, else each shard's rows."""
    if isinstance(shards[0], RowParallelLinear):
        return torch.cat([_dense(s) for s in shards], dim=1)
    if not isinstance(shards[0], MergedLinear):
        return torch.cat([_dense(s) for s in shards], dim=0)
    parts = []
    for shard in shards[0].shard_offsets:
        for s in shards:
            offset, size = s.shard_offsets[shard]
            parts.append(_dense(s)[offset : offset + size])
    return torch.cat(parts, dim=0)


def _assert_shards_join(model_dir: Path, checkpoint: Checkpoint, quantization: str | None) -> set[str]:
    whole = _load(model_dir, checkpoint, SINGLE, quantization)
    ranks = [_load(model_dir, checkpoint, TensorParallel(rank, 2), quantization) for rank in range(2)]
    for name, module in whole.items():
        shards = [rank[name] for rank in ranks]
        assert all(s.in_features * s.out_features * 2 == module.in_features * module.out_features for s in shards)
        assert torch.equal(_joined(shards), _dense(module)), name
    return {type(m.quantized).__name__ for m in whole.values()}


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_float_and_int8_shards_join_to_the_whole_weights(model_dir, quantization) -> None:
    """Column shards (q/k/v heads, gate/up rows, vocabulary rows) and row shards (o/down input columns) of the
    float weights, and of int8 blocks of 32 quantized per rank, are the one-rank weights exactly."""
    kinds = _assert_shards_join(model_dir, SafetensorsCheckpoint(model_dir), quantization)
    assert kinds == ({"NoneType"} if quantization is None else {"NoneType", "QuantizedWeight"})  # the head in dtype


def test_gguf_shards_keep_the_files_blocks(model_dir, tmp_path) -> None:
    """Q8_0 (blocks of 32): each rank serves whole rows, or whole blocks of each row, of the file's own blocks."""
    path = write_gguf(model_dir, tmp_path / "model-Q8_0.gguf", "Q8_0")
    checkpoint = GGUFCheckpoint(GGUFFile(path), num_heads=4, num_kv_heads=2)
    assert _assert_shards_join(model_dir, checkpoint, "gguf") == {"GGMLWeight"}


def test_a_shard_that_cuts_a_gguf_block_is_refused(model_dir, tmp_path) -> None:
    """Q4_K blocks hold 256 features: o_proj's 256 inputs split over two ranks would cut them."""
    path = write_gguf(model_dir, tmp_path / "model-Q4_K_M.gguf", "Q4_K_M")
    checkpoint = GGUFCheckpoint(GGUFFile(path), num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"each rank 128 input features of 'blk\.0\.attn_output\.weight', which cuts "
                                         r"its Q4_K blocks of 256"):
        _load(model_dir, checkpoint, TensorParallel(0, 2), "gguf")
