"""Real model shapes, and random-weight Hugging Face models of them (like vLLM's dummy load format).

``SHAPES`` holds the published ``config.json`` values of SmolLM2, Llama 3 and Qwen 2.5 / 3 models as
transformers config kwargs; ``make_random_model("SmolLM2-1.7B", out_dir)`` writes a directory with
that config, seeded random weights and a tokenizer of the shape's vocab size, so sizes that cannot
be downloaded can still be run, benchmarked and converted to GGUF.
"""

from __future__ import annotations

import json
import logging
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.model_files.random_tokenizer import write_tokenizer
from engine.model_files.safetensors_io import TensorSpec, write_safetensors

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
MAX_SHARD_BYTES = 2 << 30
# Matrices N(0, 1 / fan_in): each projection keeps its input's scale at any width. The embedding (the head
# when tied) and the head N(0, (LOGIT_STD / hidden)^2 * hidden): logits of about LOGIT_STD units whatever the
# width, a softmax whose top token holds a few percent (transformers' N(0, 0.02) gives nearly flat logits
# on small widths and a different spread on every shape).
LOGIT_STD = 3.0
BIAS_STD = 0.02
_CHUNK_ELEMENTS = 1 << 22

_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class ModelShape:
    """A published model's architecture: its ``model_type`` and transformers config kwargs."""

    name: str
    model_type: str
    config: dict[str, Any] = field(hash=False)

    @property
    def head_dim(self) -> int:
        return self.config.get("head_dim") or self.config["hidden_size"] // self.config["num_attention_heads"]

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's Hugging Face name and shape, in the order a checkpoint stores them."""
        c = self.config
        hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        q_rows = c["num_attention_heads"] * self.head_dim
        kv_rows = c["num_key_value_heads"] * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (hidden,)
            shapes[p + "self_attn.q_proj.weight"] = (q_rows, hidden)
            shapes[p + "self_attn.k_proj.weight"] = (kv_rows, hidden)
            shapes[p + "self_attn.v_proj.weight"] = (kv_rows, hidden)
            if self.model_type == "qwen2":
                shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
                shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
                shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
            if self.model_type == "qwen3":
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            shapes[p + "self_attn.o_proj.weight"] = (hidden, q_rows)
            shapes[p + "post_attention_layernorm.weight"] = (hidden,)
            shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes["model.norm.weight"] = (hidden,)
        if not c["tie_word_embeddings"]:
            shapes["lm_head.weight"] = (vocab, hidden)
        return shapes

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in self.tensor_shapes().values())


def _llama3_rope(theta: float, factor: float) -> dict[str, Any]:
    return {"rope_theta": theta, "rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


def _shape(name: str, model_type: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int,
           max_positions: int, tied: bool, rms_norm_eps: float, **extra: Any) -> ModelShape:
    config = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=max_positions,
                  tie_word_embeddings=tied, rms_norm_eps=rms_norm_eps, **extra)
    return ModelShape(name, model_type, config)


# The published config.json values (hidden, intermediate, layers, heads, KV heads, vocab, max positions,
# tied embeddings, RMS norm epsilon, rope).
SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _shape("SmolLM2-135M", "llama", 576, 1536, 30, 9, 3, 49152, 8192, True, 1e-5, rope_theta=100000.0),
        _shape("SmolLM2-360M", "llama", 960, 2560, 32, 15, 5, 49152, 8192, True, 1e-5, rope_theta=100000.0),
        _shape("SmolLM2-1.7B", "llama", 2048, 8192, 24, 32, 32, 49152, 8192, True, 1e-5, rope_theta=130000.0),
        _shape("Llama-3.2-1B", "llama", 2048, 8192, 16, 32, 8, 128256, 131072, True, 1e-5, head_dim=64,
               **_llama3_rope(500000.0, 32.0)),
        _shape("Llama-3.2-3B", "llama", 3072, 8192, 28, 24, 8, 128256, 131072, True, 1e-5, head_dim=128,
               **_llama3_rope(500000.0, 32.0)),
        _shape("Llama-3-8B", "llama", 4096, 14336, 32, 32, 8, 128256, 8192, False, 1e-5, rope_theta=500000.0),
        _shape("Llama-3.1-8B", "llama", 4096, 14336, 32, 32, 8, 128256, 131072, False, 1e-5,
               **_llama3_rope(500000.0, 8.0)),
        _shape("Qwen2.5-0.5B", "qwen2", 896, 4864, 24, 14, 2, 151936, 32768, True, 1e-6, rope_theta=1000000.0),
        _shape("Qwen2.5-1.5B", "qwen2", 1536, 8960, 28, 12, 2, 151936, 32768, True, 1e-6, rope_theta=1000000.0),
        _shape("Qwen2.5-7B", "qwen2", 3584, 18944, 28, 28, 4, 152064, 32768, False, 1e-6, rope_theta=1000000.0),
        _shape("Qwen3-0.6B", "qwen3", 1024, 3072, 28, 16, 8, 151936, 40960, True, 1e-6, head_dim=128,
               rope_theta=1000000.0),
        _shape("Qwen3-1.7B", "qwen3", 2048, 6144, 28, 16, 8, 151936, 40960, True, 1e-6, head_dim=128,
               rope_theta=1000000.0),
        _shape("Qwen3-8B", "qwen3", 4096, 12288, 36, 32, 8, 151936, 40960, False, 1e-6, head_dim=128,
               rope_theta=1000000.0),
    )
}


def get_shape(name: str) -> ModelShape:
    """Raises:
        ValueError: no shape of that name (the message lists them).
    """
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; expected one of {', '.join(SHAPES)}")
    return SHAPES[name]


def make_random_model(
    shape: str | ModelShape, out_dir: str | os.PathLike[str], dtype: str = "bfloat16", seed: int = 0
) -> Path:
    """Write a Hugging Face directory of ``shape`` with seeded random weights.

    Projections are N(0, 1 / fan_in), the embedding and head scaled for logits of about ``LOGIT_STD``,
    norm weights 1 + N(0, 0.1), biases N(0, 0.02^2). Each tensor has its own stream (seeded by ``seed``
    and its name), is generated in row chunks and written into safetensors shards of at most
    ``MAX_SHARD_BYTES``, so memory stays a few MB whatever the model.
    The tokenizer is the bundled SmolLM2's, padded to the shape's vocab size, with its chat template.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: an unknown shape or dtype.
    """
    shape = get_shape(shape) if isinstance(shape, str) else shape
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special_ids = write_tokenizer(out, shape.config["vocab_size"], shape.model_type)
    _write_config(shape, out, dtype, special_ids)
    specs = [TensorSpec(name, dims, DTYPES[dtype]) for name, dims in shape.tensor_shapes().items()]
    shards = _shards(specs)
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / file_name, shard, lambda spec: _random_values(spec, seed))
        weight_map.update({spec.name: file_name for spec in shard})
    if len(shards) > 1:
        total = sum(math.prod(s.shape) * (4 if s.dtype == "F32" else 2) for s in specs)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    logger.info("wrote a random %s (%.2fB parameters, %s) to %s", shape.name, shape.num_parameters / 1e9, dtype, out)
    return out


def _shards(specs: list[TensorSpec]) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = math.prod(spec.shape) * (4 if spec.dtype == "F32" else 2)
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _random_values(spec: TensorSpec, seed: int) -> Iterator[np.ndarray]:
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    if len(spec.shape) == 1:
        if spec.name.endswith("norm.weight"):
            yield 1.0 + 0.1 * rng.standard_normal(spec.shape, dtype=np.float32)
        else:
            yield BIAS_STD * rng.standard_normal(spec.shape, dtype=np.float32)
        return
    rows, length = spec.shape
    vocab_side = spec.name in ("model.embed_tokens.weight", "lm_head.weight")
    std = np.float32((LOGIT_STD if vocab_side else 1.0) / math.sqrt(length))
    step = max(1, _CHUNK_ELEMENTS // length)
    for first in range(0, rows, step):
        yield std * rng.standard_normal((min(step, rows - first), length), dtype=np.float32)


def _write_config(shape: ModelShape, out: Path, dtype: str, special_ids: dict[str, int]) -> None:
    import transformers

    config_class = getattr(transformers, _CONFIG_CLASSES[shape.model_type])
    config = config_class(
        **shape.config,
        architectures=[_ARCHITECTURES[shape.model_type]],
        bos_token_id=special_ids["bos"],
        eos_token_id=special_ids["eos"],
        pad_token_id=special_ids.get("pad"),
        dtype=dtype,
    )
    config.save_pretrained(out)
    generation = {"bos_token_id": special_ids["bos"], "eos_token_id": special_ids["eos"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
