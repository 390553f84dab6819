"""llama.cpp's conventions per GGUF architecture that both reading and writing a GGUF follow: tensor names, Gemma's
norm weights stored as ``1 + w``, and what a Gemma file's metadata leaves to llama.cpp's rules (its layers'
sliding pattern, its query scale). No torch, no numpy."""

from __future__ import annotations

from typing import Any

# Hugging Face names of a decoder layer's tensors (without .weight / .bias) -> llama.cpp's
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}  # fmt: skip
# Gemma 2/3: a norm after the attention and after the MLP; the MLP's input norm is ffn_norm
_GEMMA_LAYER_NAMES = {
    **LAYER_NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip
TOP_NAMES = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm"}
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# llama.cpp's layer pattern where a file names none: every n-th layer full, the others sliding
_GEMMA_FULL_EVERY = {"gemma2": 2, "gemma3": 6}
# the 27B models, whose query scale is hidden_size / num_heads in llama.cpp (it tells them by their layer count)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def layer_names(architecture: str) -> dict[str, str]:
    """Hugging Face layer tensor names -> GGUF ones for a GGUF architecture."""
    return _GEMMA_LAYER_NAMES if architecture in GEMMA_ARCHITECTURES else LAYER_NAMES


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


def apply_gguf_metadata(config: Any, metadata: dict[str, Any]) -> None:
    """Completes a transformers config read from a Gemma GGUF with what transformers does not map: the soft caps the
    file records, Gemma 3's linear rope scaling of its full layers, and llama.cpp's layer pattern and query scale.
    Other architectures are left as they are."""
    arch = str(metadata.get("general.architecture", ""))
    if arch not in GEMMA_ARCHITECTURES:
        return
    config.layer_types = gemma_layer_types(arch, config.num_hidden_layers)
    config.query_pre_attn_scalar = gemma_query_pre_attn_scalar(
        arch, config.hidden_size, config.num_attention_heads, config.head_dim, config.num_hidden_layers
    )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"{arch}.{key}" in metadata:
            setattr(config, key, float(metadata[f"{arch}.{key}"]))
    if arch == "gemma3" and metadata.get(f"{arch}.rope.scaling.type") == "linear":
        full = config.rope_parameters["full_attention"]
        full.update(rope_type="linear", factor=float(metadata[f"{arch}.rope.scaling.factor"]))
