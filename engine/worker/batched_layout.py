"""A GGUF model's second layout of its linear weights, for steps of many rows (``BatchedWeight``).

Where the file's blocks are served (``weight_formats``) and the dense layout of all of them fits
``EngineConfig.batched_weights_memory``, each quantized block weight (not one of a float type, not a mixture of
experts' expert) is converted at load into the engine's fastest dense batched format: symmetric int8 blocks of
its dequantized rows for int8 products (``quantization="w8a8"``'s, on AVX512-VNNI; converted in C,
``GGMLWeight.int8_panels``) with the output head in bfloat16 panels, or bfloat16 panels throughout on a CPU
without VNNI. A step of ``BATCHED_MIN_ROWS`` rows or more then multiplies those, a smaller one the blocks.
Greedy output then depends on how many rows share a step, as the two layouts round differently;
``batched_weights_memory=0`` keeps the blocks alone, batch-invariant.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from engine import cpu_kernels
from engine.cpu_kernels import LINEAR_PANEL
from engine.cpu_kernels.linear_ops import BF16_K_ALIGN
from engine.layers.batched_weight import BATCHED_MIN_ROWS, BatchedWeight, PackedWeight
from engine.layers.ggml_weight import GGMLWeight
from engine.layers.linear import Linear
from engine.layers.moe import SparseMoeBlock
from engine.layers.quantization import QBLOCK
from engine.worker.weight_formats import WeightsSummary

logger = logging.getLogger(__name__)

# GGUF's float types multiply x as it is, no int8 rounding: a weight with a part of one keeps it alone
_FLOAT_TYPES = ("F32", "F16", "BF16")


def _int8_products(module: Linear, is_head: bool) -> bool:
    """Whether ``module``'s dense layout is int8 blocks for int8 products (else bfloat16 panels)."""
    return not is_head and module.in_features % QBLOCK == 0 and cpu_kernels.int8_linear_path() != "generic"


def dense_bytes(module: Linear, is_head: bool) -> int:
    """The bytes of ``module``'s dense layout (``pack``'s int8 codes and float32 scales, or
    ``pack_linear_weight``'s bfloat16 panels), rows padded to whole panels."""
    rows = -(-module.out_features // LINEAR_PANEL) * LINEAR_PANEL
    if _int8_products(module, is_head):
        return rows * module.in_features + rows * (module.in_features // QBLOCK) * 4
    width = -(-module.in_features // BF16_K_ALIGN) * BF16_K_ALIGN
    return rows * width * 2


def add_batched_layout(model: nn.Module, limit: int, summary: WeightsSummary) -> None:
    """Gives every ``Linear`` of ``model`` served in GGUF blocks its dense layout too (``BatchedWeight``) where
    all of them take ``limit`` bytes or fewer; records what it holds in ``summary.batched``."""
    head = getattr(model, "lm_head", None)
    # NOTE: an expert multiplies its own tokens' rows, not the step's, so experts keep their blocks alone and
    # the decoder plan and the modules pick the same layout for every weight
    experts = {id(m) for block in model.modules() if isinstance(block, SparseMoeBlock) for m in block.experts.modules()}
    blocks = [
        (m, m is head) for m in model.modules()
        if isinstance(m, Linear) and isinstance(m.quantized, GGMLWeight) and id(m) not in experts
        and not any(part.type_name in _FLOAT_TYPES for part in m.quantized.parts)
    ]  # fmt: skip
    if not blocks or limit == 0:
        return
    needed = sum(dense_bytes(module, is_head) for module, is_head in blocks)
    if needed > limit:
        logger.info(
            "the GGUF blocks alone serve every step: their dense layout for batches would take %.1f MiB, over "
            "batched_weights_memory (%.1f MiB)", needed / 2**20, limit / 2**20,
        )  # fmt: skip
        return
    kinds: Counter[str] = Counter()
    held = 0
    for module, is_head in blocks:
        if _int8_products(module, is_head):
            dense = module.quantized.int8_panels()
        else:  # float32 [out, in] for a moment: one layer's at a time
            packed = cpu_kernels.pack_linear_weight(module.quantized.dequantize().to(torch.bfloat16))
            dense = PackedWeight(packed, module.out_features, module.in_features)
        module.quantize(BatchedWeight(module.quantized, dense, BATCHED_MIN_ROWS))
        kinds[dense.kind] += 1
        held += dense.nbytes
    int8 = f"int8 ({cpu_kernels.int8_linear_path()})" if kinds["q8"] else None
    bf16 = f"bfloat16 ({cpu_kernels.bf16_linear_path(1 << 16)})"
    summary.batched = {"modules": dict(kinds), "bytes": held, "limit": limit, "min_rows": BATCHED_MIN_ROWS}
    summary.products += f"; from {BATCHED_MIN_ROWS} rows " + (f"{int8}, output head {bf16}" if int8 else bf16)
