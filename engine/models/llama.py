"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2; Qwen2/Qwen3 via flags) over a flat token batch."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.distributed.parallel_state import current_tensor_parallel, shard_units
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.linear import default_weight_loader
from engine.layers.norm import RMSNorm
from engine.layers.parallel_linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.layers.rotary import RotaryEmbedding, rope_inv_freq

# checkpoint name fragment -> (our fused parameter's fragment, shard)
FUSED_SHARDS = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}


class LlamaAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        # this rank's heads (all of them on one rank)
        tp = current_tensor_parallel()
        self.num_heads = shard_units(heads, tp, "attention heads").count
        self.num_kv_heads = shard_units(kv_heads, tp, "KV heads").count
        q_size, kv_size = heads * self.head_dim, kv_heads * self.head_dim
        self.qkv_proj = MergedColumnParallelLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=qkv_bias,
            units={"q": heads, "k": kv_heads, "v": kv_heads},
        )  # fmt: skip
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=o_bias, units=heads)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
            sliding_window=getattr(config, "sliding_window", None),
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
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, {"gate": size, "up": size}, bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, o_bias, qk_norm)
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
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary, qkv_bias, o_bias, qk_norm) for _ in range(config.num_hidden_layers)
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
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N, vocab]
        """The logits (the matmul, also when the head is the tied embedding); None on a tensor-parallel rank
        other than the first."""
        return self.lm_head.logits(hidden)

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
