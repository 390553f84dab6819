"""A model's weights from its checkpoint, each linear layer in the format it is served in.

``load_weights`` fills a model built on the meta device, module by module, so that no more than one layer's
weight exists twice at any moment (peak memory about the model's own size); a model's ``checkpoint_renames``
(pairs of name fragments, or a method that picks them for the checkpoint at hand) map its module names to its
checkpoint's. A ``Linear`` (the embedding among
them) is served:

- from a GGUF file (``quantization`` None or ``"gguf"``, on the CPU kernels): in the file's own types, read as
  the file stores them (``GGMLWeight``: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16, F32); a
  tensor of another type (Q2_K, Q3_K, the IQ types) is dequantized to the weights' dtype, and the start-up log
  names those tensors and the memory they take;
- ``"int8"``: 8-bit min/max blocks of 32 weights quantized from the float values (weight-only), the output head
  (``lm_head``, or the tied embedding) kept in dtype because its error goes straight into the logits (on the
  bundled model it was all of int8's: 5 of 8 prompts kept float32's greedy tokens with it quantized, 8 of 8
  without);
- ``"w8a8"``: symmetric 8-bit blocks of the weights rotated by ``hadamard_blocks``, packed for int8 products
  (``engine/cpu_kernels/linear_int8.c``); the output head again in dtype;
- a mixture of experts' experts are ``Linear`` layers like any other (each expert its own, served as above); the
  router's weight is a plain parameter in dtype, so quantization never changes which experts a token takes;
- otherwise in the weights' dtype (a Hugging Face checkpoint's bfloat16 stays bfloat16 where the engine keeps
  bfloat16 weights), packed into the C kernels' panels on CPU.

The returned ``WeightsSummary`` says what runs; ``Engine.stats()`` and the start-up log show it.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from engine import cpu_kernels
from engine.layers.ggml_weight import GGML_NATIVE, GGMLWeight
from engine.layers.linear import CheckpointSlice, Linear, MergedLinear, default_weight_loader
from engine.layers.quantization import QBLOCK, hadamard_blocks, pack, quantize_int8, quantize_symmetric_int8
from engine.model_files.checkpoint import Checkpoint, GGUFCheckpoint, SafetensorsCheckpoint
from engine.model_files.gguf import GGML_TYPES, TYPE_IDS
from engine.models.llama import FUSED_SHARDS

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "w8a8", "gguf")

# a fused module's name fragment and shard -> the checkpoint's name fragment of that shard
_SHARD_NAMES = {(fused, shard): fragment for fragment, (fused, shard) in FUSED_SHARDS.items()}


@dataclass
class WeightsSummary:
    """What the linear weights run as: modules per kind (a ggml type such as ``Q4_K``, ``q8`` for the int8
    blocks, or a float dtype), the bytes all linear weights take, and what was dequantized at load."""

    quantization: str | None
    modules: Counter[str] = field(default_factory=Counter)
    nbytes: int = 0
    products: str = "float32"  # what the CPU kernels multiply in (the model runner sets it)
    dequantized: list[str] = field(default_factory=list)  # GGUF tensors of a type not served natively
    # a GGUF model's second layout for steps of many rows (batched_layout): {"modules": {kind: count}, "bytes",
    # "limit" (batched_weights_memory), "min_rows"}; None where the blocks alone serve every step
    batched: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "quantization": self.quantization, "modules": dict(self.modules), "bytes": self.nbytes,
            "products": self.products, "batched": self.batched,
        }  # fmt: skip

    def __str__(self) -> str:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.modules.items()))
        second = f" + {self.batched['bytes'] / 2**20:.1f} MiB for batches" if self.batched else ""
        return (
            f"quantization {self.quantization} ({kinds}; {self.nbytes / 2**20:.1f} MiB{second}; "
            f"{self.products} products)"
        )


@dataclass(frozen=True)
class LoadPlan:
    """How ``load_weights`` serves the linear weights: ``quantization`` (None, or one of ``QUANTIZATIONS``),
    ``dtype`` the activations' and norms', ``weight_dtype`` the float weights', ``packed`` whether the CPU kernels
    serve them (else ``F.linear`` over plain parameters), ``bf16_products`` whether quantized layers may multiply
    in bfloat16 (``QuantizedWeight``)."""

    quantization: str | None
    dtype: torch.dtype
    weight_dtype: torch.dtype
    device: torch.device
    packed: bool
    bf16_products: bool = False


def load_weights(model: nn.Module, checkpoint: Checkpoint, plan: LoadPlan) -> WeightsSummary:
    """Materialize ``model`` (built on the meta device) from ``checkpoint`` as ``plan`` says (module docstring).

    Raises:
        ValueError: a parameter the checkpoint lacks or holds in another shape; ``"gguf"`` for a checkpoint that
            is not a GGUF file.
    """
    gguf = checkpoint if isinstance(checkpoint, GGUFCheckpoint) else None
    if plan.quantization == "gguf" and gguf is None:
        raise ValueError("quantization='gguf' serves the blocks of a .gguf model; this model is not a GGUF file")
    linears = {name: module for name, module in model.named_modules() if isinstance(module, Linear)}
    for module in linears.values():  # allocated by their format below, not here
        module.weight = None
    model.to_empty(device=plan.device)
    renames = getattr(model, "checkpoint_renames", ())
    if callable(renames):  # a model whose checkpoints come in several layouts picks the pairs by the names present
        renames = renames(checkpoint)
    for name, param in model.named_parameters():
        if name.endswith(".bias") and name.rpartition(".")[0] in linears:
            continue  # with its layer
        _copy(param.data, checkpoint, _renamed(name, renames))
    summary = WeightsSummary(plan.quantization)
    head = getattr(model, "lm_head", None)
    if head is None and getattr(model, "tie_word_embeddings", False):  # a pipeline stage before the last
        head = model.model.embed_tokens  # the tied head's table, kept as the last stage keeps it
    for name, module in linears.items():
        shards = _checkpoint_names(name, module, renames, checkpoint)
        if module.bias is not None:
            _fill(module.bias.data, module, [f"{shard}.bias" for shard in shards], checkpoint)
        kind = _serve(module, [f"{shard}.weight" for shard in shards], checkpoint, plan, module is head, summary)
        summary.modules[kind] += 1
    summary.dequantized = list(dict.fromkeys(summary.dequantized))  # a 3-D experts tensor once, not per expert
    if summary.dequantized:
        why = "the CPU kernels do not serve their types" if plan.packed else "GGUF types run natively on the CPU kernels only"
        logger.warning(
            "%d GGUF tensors dequantized to %s (%s; the linear weights take %.1f MiB): %s",
            len(summary.dequantized), plan.weight_dtype, why, summary.nbytes / 2**20, ", ".join(summary.dequantized),
        )
    return summary


def _serve(module: Linear, names: list[str], checkpoint: Checkpoint, plan: LoadPlan, is_head: bool,
           summary: WeightsSummary) -> str:
    """Loads ``module``'s weight from the checkpoint tensors ``names`` (its shards, in row order) in the format
    the plan gives it; returns the format's kind and adds its bytes to the summary."""
    if isinstance(checkpoint, GGUFCheckpoint) and plan.quantization in (None, "gguf"):
        types = [checkpoint.type_name(name) for name in names]
        if plan.packed and all(t in GGML_NATIVE for t in types):
            parts = [(t, _blocks(checkpoint, n, t, module.checkpoint_slice(s)))
                     for t, n, s in zip(types, names, _shards(module))]
            weight = GGMLWeight.from_numpy(parts, module.in_features)
            module.quantize(weight)
            summary.nbytes += weight.nbytes
            return weight.kind
        summary.dequantized += [f"{checkpoint.gguf_name(n)} ({t})" for n, t in zip(names, types)]
    if plan.quantization in ("int8", "w8a8") and not is_head and module.in_features % QBLOCK == 0:
        weight = _float_weight(module, names, checkpoint, torch.float32)
        blocks = quantize_symmetric_int8(hadamard_blocks(weight)) if plan.quantization == "w8a8" else quantize_int8(weight)
        del weight
        packed = pack(blocks, int8_products=plan.quantization == "w8a8")
        module.quantize(packed._replace(bf16_products=plan.bf16_products and not packed.int8_products))
        summary.nbytes += module.quantized.nbytes
        return blocks.kind
    weight = _float_weight(module, names, checkpoint, plan.weight_dtype)
    if plan.packed:
        module.packed = cpu_kernels.pack_linear_weight(weight)
        summary.nbytes += module.packed.nbytes
    else:
        module.weight = nn.Parameter(weight.to(plan.device), requires_grad=False)
        summary.nbytes += weight.nbytes
    return str(plan.weight_dtype).removeprefix("torch.")


def _float_weight(module: Linear, names: list[str], checkpoint: Checkpoint, dtype: torch.dtype) -> torch.Tensor:
    """The module's float weight ``[out, in]`` in ``dtype``, its shards read in turn into their rows."""
    weight = torch.empty(module.out_features, module.in_features, dtype=dtype)
    _fill(weight, module, names, checkpoint)
    return weight


def _fill(target: torch.Tensor, module: Linear, names: list[str], checkpoint: Checkpoint) -> None:
    """Copies the checkpoint tensors ``names`` (a module's shards in row order, or its one tensor; of each, the
    part the module holds) into ``target``'s rows."""
    if len(names) > 1:
        for shard, name in zip(module.shard_offsets, names):
            offset, size = module.shard_offsets[shard]
            _copy(target.narrow(0, offset, size), checkpoint, name, module.checkpoint_slice(shard))
    else:
        _copy(target, checkpoint, names[0], module.checkpoint_slice(None))


def _shards(module: Linear) -> list[str | None]:
    return list(module.shard_offsets) if isinstance(module, MergedLinear) else [None]


def _copy(target: torch.Tensor, checkpoint: Checkpoint, name: str, part: CheckpointSlice | None = None) -> None:
    if name not in checkpoint:
        raise ValueError(f"checkpoint lacks {name!r}")
    if part is not None and part.dim < len(checkpoint.shape(name)):
        default_weight_loader(target, checkpoint.tensor(name).narrow(part.dim, part.start, part.size))
    elif isinstance(checkpoint, SafetensorsCheckpoint) and checkpoint.dtype(name) == target.dtype \
            and tuple(target.shape) == checkpoint.shape(name) and target.is_contiguous() and target.is_cpu:
        checkpoint.tensor(name, out=target)  # read in place: no copy of the tensor in between
    else:
        default_weight_loader(target, checkpoint.tensor(name))


def _blocks(checkpoint: GGUFCheckpoint, name: str, type_name: str, part: CheckpointSlice | None) -> np.ndarray:
    """A GGUF tensor's rows of blocks (``GGUFCheckpoint.blocks``), of them the part a module holds: whole rows,
    or whole blocks of each row.

    Raises:
        ValueError: the part cuts a block (a tensor-parallel rank's input features not a multiple of the block).
    """
    rows = checkpoint.blocks(name)
    if part is None or part.dim >= len(checkpoint.shape(name)):
        return rows
    if part.dim == 0:
        return rows[part.start : part.start + part.size]
    _, block, block_bytes = GGML_TYPES[TYPE_IDS[type_name]]
    if part.start % block or part.size % block:
        raise ValueError(
            f"tensor_parallel_size gives each rank {part.size} input features of {checkpoint.gguf_name(name)!r}, "
            f"which cuts its {type_name} blocks of {block}"
        )
    return rows[:, part.start // block * block_bytes : (part.start + part.size) // block * block_bytes]


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """``name`` with each ``(ours, checkpoint's)`` fragment of a model's ``checkpoint_renames`` replaced in turn
    (fragments are dot-delimited: ``.gate_proj.`` matches a name's last component too)."""
    dotted = f"{name}."
    for ours, theirs in renames:
        dotted = dotted.replace(ours, theirs)
    return dotted[:-1]


def _checkpoint_names(
    name: str, module: Linear, renames: tuple[tuple[str, str], ...], checkpoint: Checkpoint
) -> list[str]:
    """The checkpoint tensors (without ``.weight``) a module's weight is loaded from, in row order: a fused
    module's shards (``q_proj``, ``k_proj``, ``v_proj``), or its own one where the checkpoint stores it fused
    (Phi-3's ``qkv_proj`` and ``gate_up_proj``)."""
    own = _renamed(name, renames)
    if not isinstance(module, MergedLinear) or f"{own}.weight" in checkpoint:
        return [own]
    dotted = f"{name}."
    names = []
    for shard in module.shard_offsets:
        for (fused, shard_name), fragment in _SHARD_NAMES.items():
            if shard_name == shard and fused in dotted:
                names.append(_renamed(dotted.replace(fused, fragment)[:-1], renames))
    return names
