"""A GGUF file's Hugging Face config: transformers' reading of its metadata, completed with what transformers leaves
out and llama.cpp's rules fill in.

- Gemma 2/3: the soft caps the file records, Gemma 3's linear rope scaling of its full layers, llama.cpp's layer
  pattern and query scale.
- Mixtral (architecture ``llama`` with ``llama.expert_count``): a ``MixtralConfig``; llama.cpp renormalizes the
  top-k weights, as Mixtral does.
- Qwen3-MoE (``qwen3moe``): the experts' width (``expert_feed_forward_length``), every layer sparse, the top-k
  weights renormalized (llama.cpp's rule for the architecture).
- Phi-3 (``phi3``): the rotated part of each head (``rope.dimension_count``), the sliding window (0: none), and
  LongRoPE from the ``rope_factors_long`` / ``rope_factors_short`` tensors and ``rope.scaling.*``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.errors import ModelLoadError
from engine.model_files.gguf import GGUFFile
from engine.model_files.gguf_arch import GEMMA_ARCHITECTURES, gemma_layer_types, gemma_query_pre_attn_scalar


def complete_config(config: Any, gguf: GGUFFile) -> Any:
    """``config`` (transformers' ``AutoConfig`` of the file) completed for the file's architecture; a new config
    where the file's model type is not transformers' reading of it (Mixtral). Other architectures as they are.

    Raises:
        ModelLoadError: a mixture of experts llama.cpp's file layout cannot describe to this engine (shared experts,
            a gating function other than softmax).
    """
    arch = gguf.architecture
    if arch in GEMMA_ARCHITECTURES:
        _complete_gemma(config, arch, gguf.metadata)
    elif arch == "llama" and int(gguf.metadata.get("llama.expert_count", 0)) > 0:
        config = _mixtral(config, gguf.metadata)
    elif arch == "qwen3moe":
        _complete_qwen3_moe(config, gguf.metadata)
    elif arch == "phi3":
        _complete_phi3(config, gguf)
    return config


def _complete_gemma(config: Any, arch: str, metadata: dict[str, Any]) -> None:
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


def _check_routing(arch: str, metadata: dict[str, Any]) -> None:
    shared = int(metadata.get(f"{arch}.expert_shared_count", 0))
    if shared:
        raise ModelLoadError(f"{arch}.expert_shared_count={shared}: shared experts are not supported")
    gating = int(metadata.get(f"{arch}.expert_gating_func", 1))
    if gating != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelLoadError(f"{arch}.expert_gating_func={gating}: only softmax routing (1) is supported")


def _mixtral(config: Any, metadata: dict[str, Any]) -> Any:
    from transformers import MixtralConfig

    _check_routing("llama", metadata)
    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    return MixtralConfig(
        **fields, num_local_experts=int(metadata["llama.expert_count"]),
        num_experts_per_tok=int(metadata["llama.expert_used_count"]), sliding_window=None,
    )  # fmt: skip


def _complete_qwen3_moe(config: Any, metadata: dict[str, Any]) -> None:
    _check_routing("qwen3moe", metadata)
    config.moe_intermediate_size = int(metadata["qwen3moe.expert_feed_forward_length"])
    config.num_experts = int(metadata["qwen3moe.expert_count"])
    config.num_experts_per_tok = int(metadata["qwen3moe.expert_used_count"])
    config.norm_topk_prob = bool(metadata.get("qwen3moe.expert_weights_norm", True))
    config.decoder_sparse_step, config.mlp_only_layers = 1, []


def _complete_phi3(config: Any, gguf: GGUFFile) -> None:
    metadata = gguf.metadata
    head_dim = config.hidden_size // config.num_attention_heads
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(metadata.get("phi3.rope.freq_base", 10000.0))}
    rope["partial_rotary_factor"] = int(metadata.get("phi3.rope.dimension_count", head_dim)) / head_dim
    window = int(metadata.get("phi3.attention.sliding_window", 0))
    config.sliding_window = window or None  # llama.cpp's convert writes 0 for none
    if "rope_factors_long.weight" in gguf.tensors:
        original = int(metadata["phi3.rope.scaling.original_context_length"])
        config.original_max_position_embeddings = original
        rope.update(
            rope_type="longrope", original_max_position_embeddings=original,
            long_factor=_floats(gguf, "rope_factors_long.weight"),
            short_factor=_floats(gguf, "rope_factors_short.weight"),
        )  # fmt: skip
        stored = metadata.get("phi3.rope.scaling.attn_factor")
        scale = config.max_position_embeddings / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        if stored is not None and not math.isclose(float(stored), default, rel_tol=1e-6):
            rope["attention_factor"] = float(stored)  # else transformers' own value, unrounded
    config.rope_parameters = rope


def _floats(gguf: GGUFFile, name: str) -> list[float]:
    info = gguf.tensors[name]
    if info.type_name != "F32":
        raise ModelLoadError(f"{name} is {info.type_name}; rope factors are read as F32")
    return [float(v) for v in gguf.read(name).view(np.float32).reshape(-1)]
