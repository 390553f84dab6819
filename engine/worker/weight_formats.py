"""The formats a model's linear weights are served in: float as loaded, ``int8`` or GGUF-native blocks.

``quantize_linears`` replaces the weights of a loaded model's ``Linear`` modules (the tied
embedding among them) by packed quantized blocks (``engine.layers.quantization``):

- ``"int8"``: every weight whose ``in_features`` is a multiple of 32 is quantized into
  8-bit min/max blocks from its loaded float values, except the output head's (``lm_head``, or
  the tied embedding): it stays in dtype, as vLLM's weight-only methods keep it, because its
  error goes straight into the logits (on the bundled model it was all of int8's: 5 of 8
  prompts kept float32's greedy tokens with it quantized, 8 of 8 without);
- ``"w8a8"``: symmetric 8-bit blocks (``quantize_symmetric_int8``) of the weights rotated by
  ``hadamard_blocks``, packed for int8 products: each matmul rotates its input's blocks the same way,
  quantizes them to int8 and multiplies in int8 (``engine/cpu_kernels/linear_int8.c``); the output head
  again in dtype;
- ``"gguf"``: the weights of a GGUF model are read from the file in their own formats
  (Q8_0, Q4_0, Q4_1) without passing through float32; weights of other GGUF types keep the
  float values the conversion cache holds.

The returned ``WeightsSummary`` says what runs; ``Engine.stats()`` and the start-up log show it.
"""

from __future__ import annotations

import logging
import re
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from torch import nn

from engine.layers.linear import Linear, MergedLinear
from engine.layers.quantization import (
    GGUF_BLOCK_BYTES, QBLOCK, QuantBlocks, concat, from_gguf, hadamard_blocks, pack, quantize_int8,
    quantize_symmetric_int8,
)
from engine.models.llama import FUSED_SHARDS

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "w8a8", "gguf")

# Hugging Face checkpoint names of a decoder layer's projections -> GGUF's
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
_GGUF_TOP_NAMES = {"model.embed_tokens": "token_embd", "lm_head": "output"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# a fused module's name fragment and shard -> the checkpoint's name fragment of that shard
_SHARD_NAMES = {(fused, shard): fragment for fragment, (fused, shard) in FUSED_SHARDS.items()}

BlocksOf = Callable[[str, Linear], "QuantBlocks | None"]


@dataclass
class WeightsSummary:
    """What the linear weights run as: modules per block kind (``q4``, ``q8``) or float dtype, and the
    bytes all linear weights take."""

    quantization: str | None
    modules: Counter[str] = field(default_factory=Counter)
    nbytes: int = 0
    products: str = "float32"  # what the CPU kernels multiply in (the model runner sets it)

    def as_dict(self) -> dict[str, Any]:
        return {
            "quantization": self.quantization, "modules": dict(self.modules), "bytes": self.nbytes,
            "products": self.products,
        }  # fmt: skip

    def __str__(self) -> str:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.modules.items()))
        return f"quantization {self.quantization} ({kinds}; {self.nbytes / 2**20:.1f} MiB; {self.products} products)"


def quantize_linears(
    model: nn.Module, method: str | None, gguf_path: Path | None, num_heads: int, num_kv_heads: int,
    bf16_products: bool = False,
) -> WeightsSummary:
    """Quantize ``model``'s linear weights in place as ``method`` says (module docstring); ``num_heads``
    and ``num_kv_heads`` undo llama.cpp's reordering of the query and key rows; ``bf16_products``: the
    quantized layers multiply in bfloat16 where the CPU can (``QuantizedWeight``).

    Raises:
        ValueError: ``"gguf"`` without a GGUF source file.
    """
    if method == "gguf" and gguf_path is None:
        raise ValueError("quantization='gguf' serves the blocks of a .gguf model; this model is not a GGUF file")
    blocks_of = _gguf_blocks(gguf_path, num_heads, num_kv_heads) if method == "gguf" else None
    summary = WeightsSummary(method)
    head = getattr(model, "lm_head", None)
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        blocks = None
        if method in ("int8", "w8a8") and module is not head and module.in_features % QBLOCK == 0:
            weight = module.weight.data
            blocks = quantize_symmetric_int8(hadamard_blocks(weight)) if method == "w8a8" else quantize_int8(weight)
        elif blocks_of is not None:
            blocks = blocks_of(name, module)
        if blocks is not None:
            packed = pack(blocks, int8_products=method == "w8a8")
            module.quantize(packed._replace(bf16_products=bf16_products and not packed.int8_products))
            summary.modules[blocks.kind] += 1
            summary.nbytes += module.quantized.nbytes
        else:
            summary.modules[str(module.weight.dtype).removeprefix("torch.")] += 1
            summary.nbytes += module.weight.nbytes
    return summary


def _checkpoint_names(name: str, module: Linear) -> list[str]:
    """The checkpoint tensors (without ``.weight``) a module's weight is loaded from, in row order."""
    if not isinstance(module, MergedLinear):
        return [name]
    dotted = f"{name}."
    names = []
    for shard in module.shard_offsets:
        for (fused, shard_name), fragment in _SHARD_NAMES.items():
            if shard_name == shard and fused in dotted:
                names.append(dotted.replace(fused, fragment)[:-1])
    return names


def _gguf_blocks(gguf_path: Path, num_heads: int, num_kv_heads: int) -> BlocksOf:
    """A lookup of each module's blocks in the GGUF file: None where a tensor is absent or of a type
    not served natively."""
    architecture, tensors = read_gguf_tensors(gguf_path)
    permuted = architecture == "llama"

    def one(checkpoint: str) -> QuantBlocks | None:
        if match := _LAYER.fullmatch(checkpoint):
            gguf_name = f"blk.{match[1]}.{_GGUF_LAYER_NAMES.get(match[2], match[2])}.weight"
        else:
            gguf_name = f"{_GGUF_TOP_NAMES.get(checkpoint, checkpoint)}.weight"
        tensor = tensors.get(gguf_name)
        if tensor is None or tensor.type_name not in GGUF_BLOCK_BYTES:
            return None
        blocks = from_gguf(tensor.type_name, tensor.data)
        if permuted and checkpoint.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = num_heads if checkpoint.endswith("q_proj") else num_kv_heads
            blocks = QuantBlocks(blocks.kind, *(_unpermute_rows(t, heads) for t in blocks[1:]))
        return blocks

    def blocks_of(name: str, module: Linear) -> QuantBlocks | None:
        parts = [one(checkpoint) for checkpoint in _checkpoint_names(name, module)]
        if not parts or any(part is None for part in parts) or len({part.kind for part in parts}) != 1:
            logger.info("%s keeps its float weight (no GGUF block of a native type for every shard)", name)
            return None
        return concat(parts)

    return blocks_of


class GGUFTensor(NamedTuple):
    """A tensor of a GGUF file: its type's name (``Q4_1``, ``F32``, ...) and its rows of raw bytes, mapped."""

    type_name: str
    data: np.ndarray  # uint8 [rows, bytes per row]


# GGUF metadata value types: fixed sizes (struct formats), 8 = string, 9 = array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_tensors(path: Path) -> tuple[str, dict[str, GGUFTensor]]:
    """The architecture and the tensors of a GGUF file (version 2 or 3), the data memory-mapped.

    Reads the header only as far as it must: the metadata is skipped but for the architecture
    and the alignment (gguf-py's reader decodes every value, the whole vocabulary included,
    which takes seconds).

    Raises:
        ValueError: not a GGUF file of a version read here.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        head = f.read(1 << 20)
        buf, pos = bytearray(head), 0

        def need(size: int) -> None:
            nonlocal buf
            while pos + size > len(buf):
                more = f.read(max(size, 1 << 20))
                if not more:
                    raise ValueError(f"{path}: truncated GGUF header")
                buf += more

        def take(fmt: str):
            nonlocal pos
            size = struct.calcsize(fmt)
            need(size)
            value = struct.unpack_from("<" + fmt, buf, pos)
            pos += size
            return value[0] if len(value) == 1 else value

        def string() -> bytes:
            nonlocal pos
            size = take("Q")
            need(size)
            pos += size
            return bytes(buf[pos - size : pos])

        def skip(value_type: int) -> None:
            nonlocal pos
            if value_type == 8:
                string()
            elif value_type == 9:
                item_type, count = take("I"), take("Q")
                if item_type in _GGUF_SCALARS:
                    size = struct.calcsize(_GGUF_SCALARS[item_type]) * count
                    need(size)
                    pos += size
                else:
                    for _ in range(count):
                        skip(item_type)
            else:
                take(_GGUF_SCALARS[value_type])

        magic, version = take("4s"), take("I")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a GGUF file of version 2 or 3")
        num_tensors, num_fields = take("Q"), take("Q")
        architecture, alignment = "", 32
        for _ in range(num_fields):
            key, value_type = string(), take("I")
            if key == b"general.architecture" and value_type == 8:
                architecture = string().decode()
            elif key == b"general.alignment" and value_type in _GGUF_SCALARS:
                alignment = int(take(_GGUF_SCALARS[value_type]))
            else:
                skip(value_type)
        infos = []
        for _ in range(num_tensors):
            name = string().decode()
            dims = [take("Q") for _ in range(take("I"))]
            infos.append((name, dims, take("I"), take("Q")))
        data_start = -(-pos // alignment) * alignment
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, dims, type_id, offset in infos:
        kind = GGMLQuantizationType(type_id)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        row_bytes = dims[0] // block * block_bytes  # dims[0]: the contiguous (input) dimension
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        start = data_start + offset
        tensors[name] = GGUFTensor(kind.name, mapped[start : start + rows * row_bytes].reshape(rows, row_bytes))
    return architecture, tensors


def _unpermute_rows(t: Any, num_heads: int) -> Any:
    """Rows of a query or key projection back in Hugging Face's order: llama.cpp interleaves the two
    rotary halves of each head."""
    rows = t.shape[0]
    return t.reshape(num_heads, rows // num_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
