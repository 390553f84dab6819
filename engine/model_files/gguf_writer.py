"""Hugging Face directories written as GGUF files, with llama.cpp's conventions, one tensor at a time.

``write_gguf(hf_dir, out_path, "Q4_K_M")`` writes what ``convert_hf_to_gguf.py`` followed by
``llama-quantize`` would for the llama (SmolLM2 included), mistral, mixtral, qwen2, qwen3, qwen3_moe,
gemma2, gemma3 (text) and phi3 architectures: tensors named ``token_embd``, ``blk.N.attn_q`` ...
``output_norm``, ``output`` (``gguf_arch``); the llama architecture's q/k rows permuted into GGML's
rotary layout; qwen2's q/k/v biases and qwen3's q/k norms; Gemma's norm weights w as ``1 + w``, its
sliding window and soft caps (a Gemma whose layer pattern or query scale llama.cpp would not infer is
refused); a mixture of experts' experts stacked per projection into 3-D ``ffn_{gate,up,down}_exps``
tensors ``[experts, rows, K]`` and its router as an F32 ``ffn_gate_inp`` (Mixtral as architecture
llama with ``llama.expert_count``; Qwen3-MoE as ``qwen3moe``, refused where llama.cpp would run it
otherwise: dense layers, top-k weights not renormalized); Phi-3's fused ``attn_qkv`` and ``ffn_up``
(gate rows first), its rotated head part, sliding window (0 for none) and LongRoPE factors as
``rope_factors_long`` / ``rope_factors_short`` tensors; llama3 rope scaling as a ``rope_freqs``
tensor; the ``<arch>.*`` hyperparameters, ``general.file_type`` and the tokenizer. Each tensor is read
from the safetensors files in row chunks, quantized and written before the next one is read, so memory
is about the largest output tensor.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFWriter, RopeScalingType

from engine.model_files.gguf_arch import (
    TOP_NAMES,
    expert_tensor,
    gemma_layer_types,
    gemma_query_pre_attn_scalar,
    layer_names,
    norms_stored_plus_one,
)
from engine.model_files.gguf_file_types import FILE_TYPES, check_file_type, tensor_types
from engine.model_files.gguf_quants import ggml_type, quantize, row_bytes
from engine.model_files.gguf_tokenizer import add_tokenizer
from engine.model_files.safetensors_io import SafetensorsReader

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
_CHUNK_ELEMENTS = 1 << 22  # rows read and quantized per step: about 16 MB of float32

_BIASED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # the layer tensors that may have a bias
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class HParams:
    """The hyperparameters a GGUF records, read from a Hugging Face ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any]  # {} when none; else its rope_type and parameters
    tie_word_embeddings: bool
    sliding_window: int | None = None  # Gemma's, on its sliding layers; Phi-3's, on every layer
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    num_experts: int = 0  # a mixture of experts': experts per layer, per token, and each expert's width
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    rotary_dim: int | None = None  # Phi-3: the rotated part of each head
    original_max_positions: int | None = None  # Phi-3's LongRoPE

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> HParams:
        """Raises:
            ValueError: an architecture other than ``GGUF_ARCHITECTURES``; a Gemma whose layer pattern, query scale
                or sliding layers' rope is not what llama.cpp infers for its file.
        """
        model_type = config.get("model_type")
        if model_type not in GGUF_ARCHITECTURES:
            raise ValueError(f"model_type {model_type!r} cannot be written; supported: {', '.join(GGUF_ARCHITECTURES)}")
        rope = dict(config.get("rope_parameters") or {})
        if model_type == "gemma3_text":  # rope per layer type: the file records the full layers'
            _check_gemma_rope(rope.get("sliding_attention") or {})
            rope = dict(rope.get("full_attention") or {})
        scaling = dict(config.get("rope_scaling") or {})
        rope_theta = config.get("rope_theta") or rope.get("rope_theta") or 10000.0
        rope_type = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type", "default")
        if rope_type not in (None, "default"):
            scaling = {**rope, **scaling, "rope_type": rope_type}
        else:
            scaling = {}
        heads = config["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            max_positions=config.get("max_position_embeddings", 2048),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            **(_gemma_fields(config) if model_type in ("gemma2", "gemma3_text") else {}),
            **(_moe_fields(config) if model_type in ("mixtral", "qwen3_moe") else {}),
            **(_phi3_fields(config, rope, heads) if model_type == "phi3" else {}),
        )

    @property
    def arch(self) -> str:
        return GGUF_ARCHITECTURES[self.model_type]


def _check_gemma_rope(sliding: dict[str, Any]) -> None:
    if sliding.get("rope_type", "default") != "default" or sliding.get("rope_theta", 10000.0) != 10000.0:
        raise ValueError(f"sliding layers' rope {sliding} cannot be written: llama.cpp runs them at base 10000, unscaled")


def _gemma_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A Gemma's window and soft caps, after checking that llama.cpp infers its layer pattern and query scale."""
    arch, layers = GGUF_ARCHITECTURES[config["model_type"]], config["num_hidden_layers"]
    if config.get("layer_types") != gemma_layer_types(arch, layers):
        raise ValueError(f"layer_types {config.get('layer_types')} cannot be written: llama.cpp reads {arch} files as "
                         f"{gemma_layer_types(arch, layers)}")  # fmt: skip
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    scalar = gemma_query_pre_attn_scalar(arch, config["hidden_size"], heads, head_dim, layers)
    if config.get("query_pre_attn_scalar") != scalar:
        raise ValueError(f"query_pre_attn_scalar={config.get('query_pre_attn_scalar')} cannot be written: llama.cpp "
                         f"scales a {arch} of these shapes by {scalar} ** -0.5")  # fmt: skip
    return {key: config.get(key) for key in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")}


def _moe_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' sizes, after checking that llama.cpp runs it as Hugging Face does (every layer sparse,
    the top-k weights renormalized: its rule for both architectures)."""
    if config["model_type"] == "mixtral":
        if config.get("sliding_window") is not None:
            raise ValueError(f"sliding_window={config['sliding_window']} cannot be written: llama.cpp runs a "
                             "mixtral file (architecture llama) with full attention")  # fmt: skip
        return {"num_experts": config["num_local_experts"], "experts_per_token": config["num_experts_per_tok"]}
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"mlp_only_layers={config.get('mlp_only_layers')}, decoder_sparse_step="
                         f"{config.get('decoder_sparse_step')} cannot be written: llama.cpp runs every qwen3moe layer "
                         "as a mixture of experts")  # fmt: skip
    if not config.get("norm_topk_prob", False):
        raise ValueError("norm_topk_prob=False cannot be written: llama.cpp renormalizes a qwen3moe token's top-k "
                         "expert weights")  # fmt: skip
    experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 5 saves the latter
    return {"num_experts": experts, "experts_per_token": config["num_experts_per_tok"],
            "expert_intermediate_size": config["moe_intermediate_size"]}  # fmt: skip


def _phi3_fields(config: dict[str, Any], rope: dict[str, Any], heads: int) -> dict[str, Any]:
    """Phi-3's rotated part of each head, its window and LongRoPE's original context."""
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    original = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    return {"rotary_dim": int(partial * config["hidden_size"]) // heads, "original_max_positions": original,
            "sliding_window": config.get("sliding_window")}  # fmt: skip


@dataclass(frozen=True)
class _Planned:
    name: str  # GGUF name
    source: str | None  # the safetensors tensor; None for rope factors, computed here, and for stacked experts
    shape: tuple[int, ...]  # numpy order: [rows, row length], [length], or [experts, rows, row length]
    permute_heads: int = 0  # llama q/k: the head count to permute rows by (0: no permutation)
    plus_one: bool = False  # Gemma's norm weights: stored as 1 + w
    experts: tuple[str, ...] = ()  # a 3-D experts tensor's sources, one per expert in order


def write_gguf(
    hf_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    file_type: str,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write the model in ``hf_dir`` as a GGUF file of ``file_type`` (``Q4_K_M``, ``Q8_0``, ``F16``, ...).

    Args:
        hf_dir: a Hugging Face directory (config.json, *.safetensors in F32/F16/BF16, tokenizer.json).
        out_path: the file to write; it appears complete or not at all.
        file_type: one of ``gguf_file_types.FILE_TYPES``.
        progress: called with the number of values of each tensor once it is written.

    Returns:
        ``out_path``.

    Raises:
        ValueError: an unknown file type or architecture, a tensor with no GGUF name, or a tokenizer
            that cannot be written.
    """
    check_file_type(file_type)
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    hparams = HParams.from_config(json.loads((hf_dir / "config.json").read_text()))
    reader = SafetensorsReader(hf_dir)
    plan = _plan(hparams, reader)
    types = tensor_types([(p.name, p.shape) for p in plan], file_type, hparams.num_layers)
    staging = out_path.with_name(out_path.name + ".partial")
    writer = GGUFWriter(staging, hparams.arch)
    try:
        _add_metadata(writer, hparams, hf_dir, file_type)
        for p in plan:
            byte_shape = (*p.shape[:-1], row_bytes(types[p.name], p.shape[-1]))
            writer.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape),
                                   raw_dtype=ggml_type(types[p.name]))  # fmt: skip
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in plan:
            writer.write_tensor_data(_encoded(p, types[p.name], reader, hparams))
            if progress is not None:
                progress(math.prod(p.shape))
        writer.close()
        os.replace(staging, out_path)
    finally:
        writer.close()
        staging.unlink(missing_ok=True)
    logger.info("wrote %s (%s, %d tensors)", out_path, file_type, len(plan))
    return out_path


def _plan(hparams: HParams, reader: SafetensorsReader) -> list[_Planned]:
    """Every tensor of the GGUF in llama-quantize's order (layer, then name; model-wide tensors first)."""
    plan = []
    experts: dict[str, dict[int, str]] = {}  # a 3-D tensor -> its experts' sources by index
    for source in reader.names():
        if expert := expert_tensor(source):
            experts.setdefault(expert.stacked, {})[expert.index] = source
            continue
        name = _gguf_name(source, hparams.arch)
        if name is None:
            continue
        if name == "output.weight" and hparams.tie_word_embeddings:
            continue
        heads = 0
        if hparams.arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            heads = hparams.num_heads
        elif hparams.arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            heads = hparams.num_kv_heads
        plus_one = norms_stored_plus_one(hparams.arch) and source.endswith("norm.weight")
        plan.append(_Planned(name, source, reader.entries[source].shape, heads, plus_one))
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(hparams.num_experts)):
            raise ValueError(f"{name}: experts {sorted(by_index)} in the checkpoint, of {hparams.num_experts}")
        sources = tuple(by_index[i] for i in range(hparams.num_experts))
        shapes = {reader.entries[source].shape for source in sources}
        if len(shapes) != 1:
            raise ValueError(f"{name}: experts of different shapes {sorted(shapes)}")
        plan.append(_Planned(name, None, (len(sources), *shapes.pop()), experts=sources))
    if hparams.rope_scaling.get("rope_type") == "llama3":
        plan.append(_Planned("rope_freqs.weight", None, (hparams.head_dim // 2,)))
    if hparams.rope_scaling.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            plan.append(_Planned(f"rope_factors_{kind}.weight", None, (len(hparams.rope_scaling[f"{kind}_factor"]),)))
    names = [p.name for p in plan]
    if len(set(names)) != len(names):
        raise ValueError(f"two tensors map to the same GGUF name in {sorted(names)}")

    def order(p: _Planned) -> tuple[int, str]:
        match = _BLOCK.match(p.name)
        return (int(match.group(1)) if match else -1, p.name)

    return sorted(plan, key=order)


def _gguf_name(source: str, arch: str) -> str | None:
    """The GGUF name of a Hugging Face tensor (None for rotary buffers, which GGUF does not store).

    Raises:
        ValueError: a tensor this writer has no name for.
    """
    if source.endswith("rotary_emb.inv_freq"):
        return None
    base, _, kind = source.rpartition(".")
    if base in TOP_NAMES and kind == "weight":
        return f"{TOP_NAMES[base]}.weight"
    match = _LAYER_NAME.match(base)
    names = layer_names(arch)
    if match and match.group(2) in names and (kind == "weight" or match.group(2) in _BIASED):
        return f"blk.{match.group(1)}.{names[match.group(2)]}.{kind}"
    raise ValueError(f"tensor {source!r} has no GGUF name; expected a checkpoint of {', '.join(GGUF_ARCHITECTURES)}")


def permute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Each head's rows from Hugging Face's rotary layout (halves) into GGML's (interleaved pairs), as
    convert_hf_to_gguf.py's ``permute`` does; works on a weight [rows, K] or a bias [rows]."""
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_factors(hparams: HParams) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp divides each rotary frequency by, for llama3 rope scaling."""
    s = hparams.rope_scaling
    factor = s.get("factor", 8.0)
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_context = s.get("original_max_position_embeddings", 8192)
    dim = hparams.head_dim
    freqs = 1.0 / (hparams.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _encoded(p: _Planned, type_name: str, reader: SafetensorsReader, hparams: HParams) -> np.ndarray:
    """The bytes of one tensor as the GGUF stores them."""
    if p.experts:  # each expert's rows after the previous one's
        return np.stack([_encoded_rows(source, type_name, reader) for source in p.experts])
    if p.name == "rope_freqs.weight":
        return llama3_rope_factors(hparams).view(np.uint8)
    if p.source is None:  # LongRoPE's rope_factors_long / _short
        kind = p.name.removeprefix("rope_factors_").removesuffix(".weight")
        return np.asarray(hparams.rope_scaling[f"{kind}_factor"], dtype=np.float32).view(np.uint8)
    if len(p.shape) == 1:
        values = reader.read(p.source)
        if p.plus_one:
            values = values + np.float32(1)
        if p.permute_heads:
            values = permute_rows(values, p.permute_heads)
        return quantize(values.reshape(1, -1), type_name).reshape(-1)
    if p.permute_heads:
        return quantize(permute_rows(reader.read(p.source), p.permute_heads), type_name)
    return _encoded_rows(p.source, type_name, reader)


def _encoded_rows(source: str, type_name: str, reader: SafetensorsReader) -> np.ndarray:
    """A 2-D tensor's rows quantized, read and quantized a chunk of rows at a time."""
    rows, length = reader.entries[source].shape
    out = np.empty((rows, row_bytes(type_name, length)), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMENTS // length)
    for first in range(0, rows, step):
        out[first : first + step] = quantize(reader.read_rows(source, first, first + step), type_name)
    return out


def _add_metadata(writer: GGUFWriter, hp: HParams, hf_dir: Path, file_type: str) -> None:
    writer.add_type("model")
    writer.add_name(hf_dir.name)
    writer.add_vocab_size(hp.vocab_size)
    writer.add_context_length(hp.max_positions)
    writer.add_embedding_length(hp.hidden_size)
    writer.add_block_count(hp.num_layers)
    writer.add_feed_forward_length(hp.intermediate_size)
    writer.add_head_count(hp.num_heads)
    writer.add_head_count_kv(hp.num_kv_heads)
    writer.add_rope_freq_base(hp.rope_theta)
    writer.add_layer_norm_rms_eps(hp.rms_norm_eps)
    # qwen3moe: always, as convert_hf_to_gguf.py writes a config's head_dim (transformers reads it only from there)
    if (hp.head_dim != hp.hidden_size // hp.num_heads or hp.arch == "qwen3moe") and not norms_stored_plus_one(hp.arch):
        writer.add_key_length(hp.head_dim)
        writer.add_value_length(hp.head_dim)
    if hp.arch == "llama":
        writer.add_rope_dimension_count(hp.head_dim)
    if hp.num_experts:
        writer.add_expert_count(hp.num_experts)
        writer.add_expert_used_count(hp.experts_per_token)
    if hp.expert_intermediate_size:
        writer.add_expert_feed_forward_length(hp.expert_intermediate_size)
    if hp.arch == "phi3":
        writer.add_rope_dimension_count(hp.rotary_dim)
        writer.add_sliding_window(hp.sliding_window or 0)  # llama.cpp's convert: 0 for none
        if hp.original_max_positions is not None:
            writer.add_rope_scaling_orig_ctx_len(hp.original_max_positions)
    if norms_stored_plus_one(hp.arch):  # Gemma: transformers reads head_dim from key_length, whatever the width
        writer.add_key_length(hp.head_dim)
        writer.add_value_length(hp.head_dim)
        if hp.sliding_window is not None:
            writer.add_sliding_window(hp.sliding_window)
    if hp.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(hp.attn_logit_softcapping)
    if hp.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(hp.final_logit_softcapping)
    rope_type = hp.rope_scaling.get("rope_type")
    if rope_type == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(hp.rope_scaling["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(hp.rope_scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(hp.rope_scaling["original_max_position_embeddings"])
    elif rope_type == "longrope" and hp.arch == "phi3":
        scale = hp.max_positions / hp.original_max_positions
        factor = hp.rope_scaling.get("attention_factor")
        if factor is None:  # transformers' and llama.cpp's default
            factor = math.sqrt(1 + math.log(scale) / math.log(hp.original_max_positions)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(factor)
    elif rope_type not in (None, "llama3"):
        raise ValueError(f"rope scaling {rope_type!r} cannot be written; supported: llama3, linear, yarn, "
                         "longrope (phi3)")  # fmt: skip
    writer.add_file_type(FILE_TYPES[file_type][0])
    writer.add_quantization_version(GGML_QUANT_VERSION)
    add_tokenizer(writer, hf_dir, hp.vocab_size)
