"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2; Qwen2/Qwen3 via flags) over a flat token batch.

A layer's sliding window comes from ``layer_sliding_window``, the one place that reads it from a config."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.linear import (
    Linear,
    MergedLinear,
    VocabEmbedding,
    default_weight_loader,
)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_inv_freq

# checkpoint name fragment -> (our fused parameter's fragment, shard)
FUSED_SHARDS = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """Layer ``layer_idx``'s sliding window, or None for full attention: where the config names each layer's
    kind in ``layer_types`` (Qwen2/Qwen3 from ``max_window_layers``) only its "sliding_attention" layers
    take ``sliding_window``; else every layer does (Mistral)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return window
    return window if layer_types[layer_idx] == "sliding_attention" else None


class LlamaAttention(nn.Module):
    def __init__(
        self, config, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
            sliding_window=layer_sliding_window(config, layer_idx),
        )  # fmt: skip

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, bias=bias)
        self.down_proj = Linear(size, config.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config, layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary, qkv_bias, o_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(head_dim, rope_inv_freq(config, head_dim), config.max_position_embeddings)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary, qkv_bias, o_bias, qk_norm)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings ``[T, hidden]`` in the activations' dtype (the table may be stored narrower:
        bfloat16 weights on a CPU computing in float32)."""
        return self.embed_tokens(input_ids).to(self.norm.weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed(input_ids), None  # [T, hidden]
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``; ``compute_logits`` on chosen rows."""

    qkv_bias: bool | None = None  # None = the config's attention_bias
    o_bias: bool | None = None
    qk_norm = False

    def __init__(self, config) -> None:
        super().__init__()
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = attention_bias if self.o_bias is None else self.o_bias
        self.model = LlamaModel(config, qkv_bias, o_bias, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return Linear.forward(self.lm_head, hidden)  # the matmul, also when the head is the tied embedding

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the (materialized) parameters, fusing q/k/v and gate/up.

        Raises:
            ValueError: a checkpoint tensor has no parameter, or a parameter got no tensor.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for fragment, (fused, shard) in FUSED_SHARDS.items():
                if fragment in name:
                    target = name.replace(fragment, fused)
                    module = self.get_submodule(target.rpartition(".")[0])
                    module.weight_loader(params[target], tensor, shard)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
                target = name
                default_weight_loader(params[target], tensor)
            loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)}")
