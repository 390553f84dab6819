"""Qwen2 / Qwen3 decoders as pooling models: embedders (Qwen3-Embedding, gte-Qwen2) and Qwen3-Reranker's
yes/no scores; causal attention over a packed batch, read once with no KV cache; the last token's state pools."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import Linear
from engine.pooling.encoder import BatchLayout


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, h, D]; cos, sin: [T, 1, D] (the two halves of D rotate together, as Hugging Face's Qwen does)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim
        self.eps = config.rms_norm_eps
        bias = config.model_type == "qwen2"  # Qwen2 has q/k/v biases, Qwen3 q/k norms
        self.q_proj = Linear(hidden, self.num_heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * head_dim, hidden, bias=False)
        self.q_norm = nn.Parameter(torch.ones(head_dim)) if config.model_type == "qwen3" else None
        self.k_norm = nn.Parameter(torch.ones(head_dim)) if config.model_type == "qwen3" else None
        self.input_norm = nn.Parameter(torch.ones(hidden))
        self.post_norm = nn.Parameter(torch.ones(hidden))
        self.gate_proj = Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        h = _rms_norm(x, self.input_norm, self.eps)  # [T, hidden]
        q = self.q_proj(h).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = _rms_norm(q, self.q_norm, self.eps), _rms_norm(k, self.k_norm, self.eps)
        x = x + self.o_proj(layout.attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v))
        h = _rms_norm(x, self.post_norm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Decoder(nn.Module):
    """A Qwen2 / Qwen3 decoder's hidden states (no LM head): ``forward`` as ``Encoder``'s, token types ignored."""

    causal = True

    def __init__(self, config, scores: bool = False) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rope_theta = float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"])
        self.eps = config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.head_dim) for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        # a reranker's one logit: the last token's state times this row (``PoolingRunner``'s yes - no)
        self.score_weight = nn.Parameter(torch.empty(config.hidden_size)) if scores else None

    def forward(self, token_ids: torch.Tensor, token_type_ids: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        x, extra = self.begin(token_ids, token_type_ids, layout)
        for i in range(len(self.layers)):
            x = self.run_layer(i, x, extra, layout)
        return self.end(x)

    # NOTE: forward in parts, as Encoder's; ``extra`` is the rotary (cos, sin) every layer reads

    def begin(self, token_ids: torch.Tensor, token_type_ids: torch.Tensor, layout: BatchLayout):
        x = self.embed_tokens(token_ids)
        inv_freq = 1.0 / self.rope_theta ** (
            torch.arange(0, self.head_dim, 2, device=x.device, dtype=torch.float32) / self.head_dim
        )
        angles = layout.positions.float()[:, None] * inv_freq[None, :]  # [T, D / 2]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [T, 1, D]
        return x, (angles.cos().to(x.dtype), angles.sin().to(x.dtype))

    def run_layer(self, i: int, x: torch.Tensor, extra, layout: BatchLayout) -> torch.Tensor:
        cos, sin = extra
        return self.layers[i](x, cos, sin, layout)

    def end(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.norm, self.eps)


    def classify(self, last_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1]`` from each input's last-token state."""
        return last_states @ self.score_weight[:, None]


def decoder_state_dict(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A Hugging Face Qwen2 / Qwen3 checkpoint's tensors (``model.`` prefix or none; lm_head dropped) -> ``Decoder``'s."""
    w = {k.removeprefix("model."): v for k, v in weights.items() if not k.startswith("lm_head.")}
    renames = {
        "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
        "input_layernorm.weight": "input_norm", "post_attention_layernorm.weight": "post_norm",
    }  # fmt: skip
    out = {"embed_tokens.weight": w["embed_tokens.weight"], "norm": w["norm.weight"]}
    for i in range(num_layers):
        prefix = f"layers.{i}."
        for name, value in w.items():
            if name.startswith(prefix):
                rest = name[len(prefix) :]
                rest = renames.get(rest, rest.removeprefix("self_attn.").removeprefix("mlp."))
                out[prefix + rest] = value
    return out
