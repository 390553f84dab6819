"""A BERT encoder's weights from its GGUF file (llama.cpp's ``bert`` tensor names), in the file's types.

F32, F16 and BF16 tensors load as the engine's dtype. A linear weight in a quantized ggml type (Q8_0, Q4_K, ...)
is served in its own blocks (``GGMLWeight``: x quantized to int8 blocks, integer products, as llama.cpp does)
where the runner computes in float32 on CPU with the C kernels built, and dequantized to the dtype elsewhere;
embedding tables and norms are dequantized (they are read by row, not multiplied).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from engine.errors import ModelLoadError
from engine.layers.ggml_weight import GGML_NATIVE, GGMLWeight
from engine.layers.linear import Linear
from engine.model_files.checkpoint import GGUFCheckpoint
from engine.model_files.gguf import GGUFError, GGUFFile

FLOAT_TYPES = ("F32", "F16", "BF16")
_TOP = {
    "word_embeddings.weight": "token_embd.weight", "position_embeddings.weight": "position_embd.weight",
    "token_type_embeddings.weight": "token_types.weight", "embed_norm.weight": "token_embd_norm.weight",
    "embed_norm.bias": "token_embd_norm.bias",
}  # fmt: skip
# Encoder's layer modules -> llama.cpp's tensors (qkv: the three, fused by output rows)
_LAYER = {
    "qkv": ("attn_q", "attn_k", "attn_v"), "attn_out": ("attn_output",), "attn_norm": ("attn_output_norm",),
    "up": ("ffn_up",), "down": ("ffn_down",), "out_norm": ("layer_output_norm",),
}  # fmt: skip


class GGUFEncoderWeights(NamedTuple):
    """What ``load_gguf_encoder`` read: the float tensors by ``Encoder`` name, and the bytes all weights take."""

    state: dict[str, torch.Tensor]
    nbytes: int


def load_gguf_encoder(model: torch.nn.Module, path: Path, num_layers: int, num_heads: int, dtype: torch.dtype,
                      device: torch.device, native_blocks: bool) -> GGUFEncoderWeights:  # fmt: skip
    """Read ``path``'s tensors for ``model`` (an ``Encoder`` on the meta device): quantized linear weights are set
    on their layers (``Linear.quantize``) where ``native_blocks``; the rest come back as a state dict to load.

    Raises:
        ModelLoadError: an unreadable file, or a tensor missing or of a type that holds no weights.
    """
    try:
        checkpoint = GGUFCheckpoint(GGUFFile(path), num_heads, num_heads)
    except (GGUFError, OSError) as e:
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file: {e}") from None
    tensors = checkpoint.file.tensors
    state: dict[str, torch.Tensor] = {}
    nbytes = 0

    def values(name: str) -> torch.Tensor:
        return checkpoint.tensor(name).to(device, dtype)

    try:
        for ours, theirs in _TOP.items():
            if theirs == "token_types.weight" and theirs not in tensors:  # a file of one segment type may lack it
                state[ours] = torch.zeros(model.token_type_embeddings.weight.shape, dtype=dtype, device=device)
                continue
            state[ours] = values(theirs)
        for i in range(num_layers):
            for module, names in _LAYER.items():
                fused = f"blk.{i}.attn_qkv" if module == "qkv" and f"blk.{i}.attn_qkv.weight" in tensors else None
                parts = [fused] if fused else [f"blk.{i}.{n}" for n in names]
                layer = model.layers[i].get_submodule(module)
                part_types = [checkpoint.type_name(f"{p}.weight") for p in parts]
                is_blocks = isinstance(layer, Linear) and native_blocks and all(
                    t in GGML_NATIVE and t not in FLOAT_TYPES for t in part_types
                )
                if is_blocks:
                    weight = GGMLWeight.from_numpy(
                        [(t, checkpoint.blocks(f"{p}.weight")) for t, p in zip(part_types, parts)], layer.in_features
                    )
                    layer.quantize(weight)
                    nbytes += weight.nbytes
                else:
                    state[f"layers.{i}.{module}.weight"] = torch.cat([values(f"{p}.weight") for p in parts])
                state[f"layers.{i}.{module}.bias"] = torch.cat([values(f"{p}.bias") for p in parts])
    except KeyError as e:
        raise ModelLoadError(f"{str(path)!r}: tensor {e.args[0]!r} missing from the GGUF file") from None
    except ValueError as e:
        raise ModelLoadError(f"{str(path)!r}: {e}") from None
    nbytes += sum(t.numel() * t.element_size() for t in state.values())
    return GGUFEncoderWeights(state, nbytes)
