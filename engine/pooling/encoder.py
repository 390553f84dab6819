"""BERT and XLM-RoBERTa encoders over packed variable-length batches: bidirectional attention, no KV cache.

The batch is one flat run of tokens (``[T]``) with ``cu_seqlens`` marking where each input
starts; every linear layer runs on the flat tokens. On CPU, bidirectional attention runs on them too
(``cpu_kernels.encoder_attention``: each input's queries over its own keys, nothing padded); elsewhere, and
for a decoder's causal attention, it lays them out by input (``[B, H, L, D]``, keys past an input's end
masked) for torch's ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.layers.linear import Linear

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

FFN_CHUNK_ROWS = 1024  # tokens a feed-forward chunk (512 to 2,048 measured alike on MiniLM)


class EncoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv = Linear(hidden, 3 * hidden, bias=True)
        self.attn_out = Linear(hidden, hidden, bias=True)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.up = Linear(hidden, inter, bias=True)
        self.down = Linear(inter, hidden, bias=True)
        self.out_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        # x: [T, hidden]
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)  # each [T, H, D]
        attn = layout.attention(q, k, v)  # [T, H * D]
        x = self.attn_norm(x + self.attn_out(attn))
        if x.shape[0] <= FFN_CHUNK_ROWS:
            return self.out_norm(x + self.down(self.act(self.up(x))))
        # NOTE: the feed-forward runs FFN_CHUNK_ROWS tokens at a time, so that its [rows, intermediate]
        # activations come from the heap again each chunk; whole (MiniLM at 32 x 200 tokens: 6,400 x 1,536
        # float32, past glibc's 32 MiB mmap threshold) each was fresh pages, faulted in at every layer (a float32
        # gelu over them took as long as a relu: 18 ms a layer of page faults, one thread)
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], FFN_CHUNK_ROWS):
            chunk = x[start : start + FFN_CHUNK_ROWS]
            out[start : start + FFN_CHUNK_ROWS] = self.out_norm(chunk + self.down(self.act(self.up(chunk))))
        return out


class BatchLayout:
    """Where each input's tokens sit in the flat batch and in the padded ``[B, L]`` layout attention uses."""

    def __init__(self, lengths: list[int], device: torch.device, causal: bool = False) -> None:
        self.lengths = lengths
        self.causal = causal  # a decoder's attention: each token sees the ones before it
        self.max_len = max(lengths)
        lengths_t = torch.tensor(lengths, device=device)
        positions = torch.arange(self.max_len, device=device)
        self.valid = positions[None, :] < lengths_t[:, None]  # [B, L] bool: a real token
        self.flat_index = self.valid.flatten().nonzero().squeeze(1)  # [T]: each token's slot in B * L
        self.key_mask = self.valid[:, None, None, :]  # [B, 1, 1, L]
        self.positions = positions[None, :].expand(len(lengths), -1)[self.valid]  # [T]: index within its input
        self.is_padded = self.flat_index.numel() != len(lengths) * self.max_len
        # [B + 1] int64: where each input starts in the flat batch; None where the CPU kernel does not serve
        self.cu_seqlens = (
            torch.tensor([0, *lengths]).cumsum(0) if is_kernel_served(device, causal) else None
        )

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _, heads, dim = q.shape
        if self.cu_seqlens is not None and k.shape[1] == heads and cpu_kernels.encoder_supports(dim, q.dtype):
            return cpu_kernels.encoder_attention(q, k, v, self.cu_seqlens, dim**-0.5)  # [T, H * D]
        b, length = len(self.lengths), self.max_len

        def padded(t: torch.Tensor) -> torch.Tensor:  # [T, h, D] -> [B, h, L, D]
            if not self.is_padded:
                return t.view(b, length, t.shape[1], dim).transpose(1, 2)
            out = t.new_zeros(b * length, t.shape[1], dim)
            out[self.flat_index] = t
            return out.view(b, length, t.shape[1], dim).transpose(1, 2)

        mask = None if not self.is_padded else self.key_mask  # [B, 1, 1, L]
        if self.causal and mask is not None:
            mask = mask & torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        is_causal = self.causal and mask is None
        kv_groups = heads // k.shape[1]  # grouped-query attention: each key head serves kv_groups query heads
        keys, values = padded(k), padded(v)
        if kv_groups > 1:
            keys, values = keys.repeat_interleave(kv_groups, 1), values.repeat_interleave(kv_groups, 1)
        out = F.scaled_dot_product_attention(padded(q), keys, values, attn_mask=mask, is_causal=is_causal)  # [B, H, L, D]
        out = out.transpose(1, 2).reshape(b * length, heads * dim)
        return out if not self.is_padded else out[self.flat_index]


def is_kernel_served(device: torch.device, causal: bool) -> bool:
    """Whether bidirectional attention on ``device`` runs the CPU kernel (for head dims it takes)."""
    return device.type == "cpu" and not causal and cpu_kernels.library() is not None


class Encoder(nn.Module):
    """A BERT / XLM-RoBERTa encoder: embeddings, post-norm layers; an optional sequence-classification head."""

    causal = False

    def __init__(self, config, num_labels: int | None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        # RoBERTa counts positions from its padding index + 1; BERT from 0
        self.position_offset = config.pad_token_id + 1 if config.model_type == "xlm-roberta" else 0
        self.head_dense = Linear(hidden, hidden, bias=True) if num_labels is not None else None
        self.head_out = Linear(hidden, num_labels, bias=True) if num_labels is not None else None

    def forward(self, token_ids: torch.Tensor, token_type_ids: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """Hidden states of every token: ``[T, hidden]``."""
        x, extra = self.begin(token_ids, token_type_ids, layout)
        for i in range(len(self.layers)):
            x = self.run_layer(i, x, extra, layout)
        return self.end(x)

    # NOTE: begin / run_layer / end are forward in parts, so that a batch can stop between two layers and go on
    # later (engine.pooling.runner.PoolingBatchRun); ``extra`` is what every layer reads besides x (here nothing)

    def begin(self, token_ids: torch.Tensor, token_type_ids: torch.Tensor, layout: BatchLayout) -> tuple[torch.Tensor, None]:
        x = (
            self.word_embeddings(token_ids)
            + self.position_embeddings(layout.positions + self.position_offset)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.embed_norm(x), None

    def run_layer(self, i: int, x: torch.Tensor, extra: None, layout: BatchLayout) -> torch.Tensor:
        return self.layers[i](x, layout)

    def end(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_labels]`` from each input's first-token state: BERT's pooler (tanh) then its
        classifier; RoBERTa's head (dense, tanh, out_proj)."""
        return self.head_out(torch.tanh(self.head_dense(cls_states)))


def _strip_prefix(name: str) -> str:
    for prefix in ("bert.", "roberta.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def encoder_state_dict(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A Hugging Face BERT / XLM-RoBERTa checkpoint's tensors -> ``Encoder``'s names (q, k, v fused)."""
    w = {_strip_prefix(k): v for k, v in weights.items()}
    out = {
        "word_embeddings.weight": w["embeddings.word_embeddings.weight"],
        "position_embeddings.weight": w["embeddings.position_embeddings.weight"],
        "token_type_embeddings.weight": w["embeddings.token_type_embeddings.weight"],
        "embed_norm.weight": w.get("embeddings.LayerNorm.weight", w.get("embeddings.LayerNorm.gamma")),
        "embed_norm.bias": w.get("embeddings.LayerNorm.bias", w.get("embeddings.LayerNorm.beta")),
    }
    for i in range(num_layers):
        p = f"encoder.layer.{i}."
        for part in ("weight", "bias"):
            out[f"layers.{i}.qkv.{part}"] = torch.cat(
                [w[f"{p}attention.self.{n}.{part}"] for n in ("query", "key", "value")], dim=0
            )
            out[f"layers.{i}.attn_out.{part}"] = w[f"{p}attention.output.dense.{part}"]
            out[f"layers.{i}.attn_norm.{part}"] = w[f"{p}attention.output.LayerNorm.{part}"]
            out[f"layers.{i}.up.{part}"] = w[f"{p}intermediate.dense.{part}"]
            out[f"layers.{i}.down.{part}"] = w[f"{p}output.dense.{part}"]
            out[f"layers.{i}.out_norm.{part}"] = w[f"{p}output.LayerNorm.{part}"]
    # BERT: pooler.dense + classifier; RoBERTa: classifier.dense + classifier.out_proj
    for dense, final in (("pooler.dense", "classifier"), ("classifier.dense", "classifier.out_proj")):
        if f"{final}.weight" in w and f"{dense}.weight" in w:
            for part in ("weight", "bias"):
                out[f"head_dense.{part}"] = w[f"{dense}.{part}"]
                out[f"head_out.{part}"] = w[f"{final}.{part}"]
    return out

