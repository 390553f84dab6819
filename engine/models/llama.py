"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2; Qwen2/3, Gemma 2/3, Phi-3 through ``DecoderSpec``) over a flat
token batch."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.activation import gated_activation
from engine.layers.attention import Attention
from engine.layers.linear import default_weight_loader
from engine.layers.norm import RMSNorm
from engine.layers.parallel_linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.layers.rotary import RotaryEmbedding, rope_parameters, rotary_embedding
from engine.parallel_state import current_pipeline_stage, current_tensor_parallel, shard_units

# checkpoint name fragment -> (our fused parameter's fragment, shard)
FUSED_SHARDS = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}


@dataclass(frozen=True)
class DecoderSpec:
    """What a family changes in the Llama decoder; a model class gives it from its config (``decoder_spec``).

    Args:
        qkv_bias, o_bias: biases on the q/k/v and output projections.
        qk_norm: Qwen3, Gemma 3: a norm over each query and key head (``norm``), before the rotary embedding.
        norm: the norm class of every norm (``GemmaRMSNorm`` scales by ``1 + weight``).
        sandwich_norms: Gemma 2/3: the attention's and the MLP's outputs are normed too (``post_attention_layernorm``,
            ``post_feedforward_layernorm``) before their residual add, the MLP's input by ``pre_feedforward_layernorm``.
        query_scale: the attention scores' scale; None: ``head_dim ** -0.5``.
        attn_logit_softcap: the attention scores' soft cap (``Attention``); None: none.
        embed_scale: a factor on the embeddings (Gemma: ``sqrt(hidden_size)``, in the activations' dtype); None: none.
        final_logit_softcap: the logits become ``c * tanh(logits / c)``; None: as they are.
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm: type[RMSNorm] = RMSNorm
    sandwich_norms: bool = False
    query_scale: float | None = None
    attn_logit_softcap: float | None = None
    embed_scale: float | None = None
    final_logit_softcap: float | None = None


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_type(config, layer_idx: int) -> str | None:
    """The config's ``layer_types`` entry of a layer (``sliding_attention``, ``full_attention``), None without them."""
    layer_types = getattr(config, "layer_types", None)
    return None if layer_types is None else layer_types[layer_idx]


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """A layer's sliding window: the config's ``sliding_window`` where ``layer_types`` marks the layer
    ``sliding_attention``, or on every layer of a config without ``layer_types`` (Mistral); else None."""
    window = getattr(config, "sliding_window", None)
    kind = layer_type(config, layer_idx)
    return window if kind is None or kind == "sliding_attention" else None


def layer_rotaries(config, head_dim: int) -> list[RotaryEmbedding]:
    """Each layer's rotary embedding: one for all, or one per layer type where the config's ``rope_parameters``
    are keyed by layer type (Gemma 3's local and global rope)."""
    kinds = [layer_type(config, i) for i in range(config.num_hidden_layers)]
    by_type = isinstance(rope_parameters(config).get(kinds[0]), dict)
    rotaries: dict[str | None, RotaryEmbedding] = {}
    for kind in kinds:
        key = kind if by_type else None
        if key not in rotaries:
            rotaries[key] = rotary_embedding(config, head_dim, key)
    return [rotaries[kind if by_type else None] for kind in kinds]


class LlamaAttention(nn.Module):
    """Self-attention of one layer: fused q/k/v projection, optional q/k norms, rotary embedding, paged attention
    with the layer's ``sliding_window``, the spec's scale and soft cap."""

    def __init__(self, config, rotary: RotaryEmbedding, spec: DecoderSpec, sliding_window: int | None) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        # this rank's heads (all of them on one rank)
        tp = current_tensor_parallel()
        self.num_heads = shard_units(heads, tp, "attention heads").count
        self.num_kv_heads = shard_units(kv_heads, tp, "KV heads").count
        q_size, kv_size = heads * self.head_dim, kv_heads * self.head_dim
        self.qkv_proj = MergedColumnParallelLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=spec.qkv_bias,
            units={"q": heads, "k": kv_heads, "v": kv_heads},
        )  # fmt: skip
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=spec.o_bias, units=heads)
        self.q_norm = spec.norm(self.head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = spec.norm(self.head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.rotary = rotary
        scale = self.head_dim**-0.5 if spec.query_scale is None else spec.query_scale
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale,
            sliding_window=sliding_window, logit_softcap=spec.attn_logit_softcap,
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
    """The gated MLP: ``down(act(gate(x)) * up(x))``, the activation the config names."""

    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, {"gate": size, "up": size}, bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act = gated_activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; each block's residual add is fused into the next norm."""

    def __init__(self, config, rotary: RotaryEmbedding, spec: DecoderSpec, sliding_window: int | None) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = spec.norm(size, eps)
        self.self_attn = LlamaAttention(config, rotary, spec, sliding_window)
        self.post_attention_layernorm = spec.norm(size, eps)  # the MLP's input norm, or (sandwich) the attention's output
        self.sandwich_norms = spec.sandwich_norms
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = spec.norm(size, eps)
            self.post_feedforward_layernorm = spec.norm(size, eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        if self.sandwich_norms:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no weights, never run; its ``sliding_window`` places it in the
    model's KV cache groups, which are the same on every stage."""

    def __init__(self, sliding_window: int | None) -> None:
        super().__init__()
        self.sliding_window = sliding_window


class LlamaModel(nn.Module):
    """The embedding, the decoder layers and the last norm; on a pipeline stage (``current_pipeline_stage`` when
    built) only that stage's layers (the others ``MissingLayer``), the embedding on the first stage (and on the last
    where the output head is the tied embedding)."""

    def __init__(self, config, spec: DecoderSpec) -> None:
        super().__init__()
        self.stage = current_pipeline_stage()
        rotaries = layer_rotaries(config, head_dim_of(config))
        self.rotary = rotaries[0]
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size)
            if self.stage.is_first or (self.stage.is_last and tied) else None
        )  # fmt: skip
        self.embed_scale = spec.embed_scale
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotaries[i], spec, layer_sliding_window(config, i))
            if self.stage.holds(i) else MissingLayer(layer_sliding_window(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = spec.norm(config.hidden_size, config.rms_norm_eps)

    def held_layers(self) -> list[tuple[int, LlamaDecoderLayer]]:
        """The decoder layers this stage holds, with their indices."""
        return [(i, layer) for i, layer in enumerate(self.layers) if not isinstance(layer, MissingLayer)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings ``[T, hidden]`` in the activations' dtype (the table may be stored narrower:
        bfloat16 weights on a CPU computing in float32), times ``embed_scale`` rounded to the table's dtype."""
        rows = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            rows = rows * torch.tensor(self.embed_scale, dtype=rows.dtype)
        return rows.to(self.norm.weight.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last norm's output ``[T, hidden]``; ``inputs_embeds`` (a multimodal model's rows) replaces
        ``embed(input_ids)``. On a pipeline stage after the first, ``intermediate`` is the previous stage's output;
        a stage before the last returns its hidden states and residual stacked, ``[2, T, hidden]``."""
        if intermediate is not None:
            x, residual = intermediate[0], intermediate[1]
        else:
            x, residual = (self.embed(input_ids) if inputs_embeds is None else inputs_embeds), None  # [T, hidden]
        for _, layer in self.held_layers():
            x, residual = layer(positions, x, residual)
        if not self.stage.is_last:
            return torch.stack((x, residual))
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``; ``compute_logits`` on chosen rows."""

    qkv_bias: bool | None = None  # None = the config's attention_bias
    o_bias: bool | None = None
    qk_norm = False

    def __init__(self, config) -> None:
        super().__init__()
        spec = self.decoder_spec(config)
        self.model = LlamaModel(config, spec)
        self.final_logit_softcap = spec.final_logit_softcap
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.model.stage.is_last:
            self.lm_head = None
        elif self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    @classmethod
    def decoder_spec(cls, config) -> DecoderSpec:
        """The family's decoder: the class's biases and q/k norms (biases default to ``attention_bias``)."""
        attention_bias = getattr(config, "attention_bias", False)
        return DecoderSpec(
            qkv_bias=attention_bias if cls.qkv_bias is None else cls.qkv_bias,
            o_bias=attention_bias if cls.o_bias is None else cls.o_bias,
            qk_norm=cls.qk_norm,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate=intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N, vocab]
        """The logits (the matmul, also when the head is the tied embedding, then the final soft cap); None on a
        tensor-parallel rank other than the first."""
        logits = self.lm_head.logits(hidden)
        if logits is not None and self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

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
