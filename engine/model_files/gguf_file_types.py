"""GGUF file types as llama.cpp names them (Q4_K_M, Q8_0, F16, ...) and the tensor type each tensor gets.

A file type is a mix: Q4_K_M keeps most weights in Q4_K but the output head (and a tied token
embedding) in Q6_K, and the attention values and FFN down-projections of "more bits" layers in
Q6_K. ``tensor_types`` follows llama-quantize's choice for dense Llama and Qwen models (its
``llama_tensor_get_type``, without an importance matrix), including the fallback to a 32-block
type for a row length that is not a multiple of 256; F32, F16 and BF16 follow
convert_hf_to_gguf.py (every 2-D weight in that type). Vectors (norms, biases) and routers stay F32.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from engine.model_files.gguf_quants import block_shape

# The value of general.file_type (llama.cpp's LLAMA_FTYPE_*) and the type most weights get.
FILE_TYPES: dict[str, tuple[int, str]] = {
    "F32": (0, "F32"),
    "F16": (1, "F16"),
    "Q4_0": (2, "Q4_0"),
    "Q4_1": (3, "Q4_1"),
    "Q8_0": (7, "Q8_0"),
    "Q5_0": (8, "Q5_0"),
    "Q5_1": (9, "Q5_1"),
    "Q4_K_M": (15, "Q4_K"),
    "Q5_K_M": (17, "Q5_K"),
    "Q6_K": (18, "Q6_K"),
    "BF16": (32, "BF16"),
}
_FLOAT_FILE_TYPES = ("F32", "F16", "BF16")
# A K-quant whose row length is not a multiple of 256 falls back to these (llama-quantize's table).
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"^blk\.(\d+)\.")


def check_file_type(file_type: str) -> str:
    """``file_type`` itself when known.

    Raises:
        ValueError: not one of ``FILE_TYPES``.
    """
    if file_type not in FILE_TYPES:
        raise ValueError(f"file type must be one of {', '.join(FILE_TYPES)}; got {file_type!r}")
    return file_type


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def tensor_types(tensors: Sequence[tuple[str, tuple[int, ...]]], file_type: str, num_layers: int) -> dict[str, str]:
    """The GGML type of each tensor of a GGUF of ``file_type``.

    Args:
        tensors: (GGUF name, numpy shape ``[rows, row length]`` or ``[length]``) of every tensor.
        file_type: one of ``FILE_TYPES``.
        num_layers: the model's block count.

    Raises:
        ValueError: an unknown file type, or a weight whose row length no block of the file type's
            family divides (llama-quantize refuses those too).
    """
    default = FILE_TYPES[check_file_type(file_type)][1]
    num_attn_v = sum(1 for name, _ in tensors if name.endswith("attn_v.weight"))
    tied = not any(name == "output.weight" for name, _ in tensors)
    chosen = {}
    for name, shape in tensors:
        if not _is_quantizable(name, shape):
            chosen[name] = "F32"
        elif file_type in _FLOAT_FILE_TYPES:
            chosen[name] = default
        else:
            wanted = _mix_choice(name, shape[-1], default, file_type, tied, num_attn_v, num_layers)
            chosen[name] = _fallback(name, shape[-1], wanted)
    return chosen


def _is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Weights of two or more dimensions, but not norms, nor a mixture of experts' router (``ffn_gate_inp``: F32 in
    every file type, as convert_hf_to_gguf.py and llama-quantize keep it)."""
    return len(shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name and "ffn_gate_inp" not in name


def _mix_choice(
    name: str, row_length: int, default: str, file_type: str, tied: bool, num_attn_v: int, num_layers: int
) -> str:
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if row_length % block_shape(default)[0]:
            return "Q8_0"
        return "Q8_0" if default == "Q8_0" else "Q6_K"
    match = _LAYER.match(name)
    if match is None or file_type not in ("Q4_K_M", "Q5_K_M"):
        return default
    layer = int(match.group(1))
    if name.endswith("attn_v.weight") and use_more_bits(layer, num_attn_v):
        return "Q6_K"
    if "ffn_down" in name and use_more_bits(layer, num_layers):
        return "Q6_K"
    return default


def _fallback(name: str, row_length: int, wanted: str) -> str:
    if row_length % block_shape(wanted)[0] == 0:
        return wanted
    if wanted not in _FALLBACK:
        raise ValueError(
            f"tensor {name!r}: rows of {row_length} are not a whole number of {wanted} blocks "
            f"({block_shape(wanted)[0]} values each)"
        )
    fallback = _FALLBACK[wanted]
    return fallback if row_length % block_shape(fallback)[0] == 0 else "F16"
