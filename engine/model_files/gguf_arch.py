"""llama.cpp's conventions per GGUF architecture that both reading and writing a GGUF follow: tensor names (a
mixture of experts' experts stacked in one 3-D tensor per projection, Phi-3's fused projections), Gemma's norm
weights stored as ``1 + w``, and what a Gemma file's metadata leaves to llama.cpp's rules (its layers' sliding
pattern, its query scale). No torch, no numpy."""

from __future__ import annotations

import re
from typing import NamedTuple

# Hugging Face names of a decoder layer's tensors (without .weight / .bias) -> llama.cpp's
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",  # a mixture of experts' router
}  # fmt: skip
# Phi-3: q/k/v in one tensor, and gate and up in one (ffn_up, gate rows first)
_PHI3_LAYER_NAMES = {**LAYER_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# Gemma 2/3: a norm after the attention and after the MLP; the MLP's input norm is ffn_norm
_GEMMA_LAYER_NAMES = {
    **LAYER_NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip
# an expert's Hugging Face tensor (Qwen3-MoE's mlp.experts.E.gate_proj, Mixtral's block_sparse_moe.experts.E.w1)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
# an expert's projection -> llama.cpp's name of it
_EXPERT_NAMES = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
                 "w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}  # fmt: skip
TOP_NAMES = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm"}
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# llama.cpp's layer pattern where a file names none: every n-th layer full, the others sliding
_GEMMA_FULL_EVERY = {"gemma2": 2, "gemma3": 6}
# the 27B models, whose query scale is hidden_size / num_heads in llama.cpp (it tells them by their layer count)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


class ExpertTensor(NamedTuple):
    """Where a GGUF holds an expert's weight: expert ``index``'s rows of the layer's 3-D ``stacked`` tensor
    ``[experts, rows, K]`` (``blk.L.ffn_gate_exps.weight``), or in files llama.cpp wrote before it stacked experts
    (April 2024), a 2-D tensor of its own (``single``: ``blk.L.ffn_gate.E.weight``)."""

    stacked: str
    index: int
    single: str


def layer_names(architecture: str) -> dict[str, str]:
    """Hugging Face layer tensor names -> GGUF ones for a GGUF architecture."""
    if architecture == "phi3":
        return _PHI3_LAYER_NAMES
    return _GEMMA_LAYER_NAMES if architecture in GEMMA_ARCHITECTURES else LAYER_NAMES


def expert_tensor(name: str) -> ExpertTensor | None:
    """Where a GGUF holds an expert's Hugging Face weight ``name`` (None for a tensor that is not an expert's)."""
    match = _EXPERT.fullmatch(name)
    if match is None or match[3] not in _EXPERT_NAMES:
        return None
    layer, index, base = match[1], int(match[2]), _EXPERT_NAMES[match[3]]
    return ExpertTensor(f"blk.{layer}.{base}_exps.weight", index, f"blk.{layer}.{base}.{index}.weight")


def norms_stored_plus_one(architecture: str) -> bool:
    """Whether llama.cpp stores the architecture's norm weights w as ``1 + w`` (Gemma: its norms scale by 1 + w)."""
    return architecture in GEMMA_ARCHITECTURES


def gemma_layer_types(architecture: str, num_layers: int) -> list[str]:
    """The layer types llama.cpp gives a Gemma file's layers (gemma2: every 2nd layer full; gemma3: every 6th)."""
    every = _GEMMA_FULL_EVERY[architecture]
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)]


def gemma_query_pre_attn_scalar(architecture: str, hidden_size: int, num_heads: int, head_dim: int,
                                num_layers: int) -> int:  # fmt: skip
    """The query scale's ``query_pre_attn_scalar`` llama.cpp uses for a Gemma file: head_dim, but hidden / heads for
    the 27B models."""
    return hidden_size // num_heads if num_layers == _GEMMA_27B_LAYERS[architecture] else head_dim
