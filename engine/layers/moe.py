"""A sparse mixture-of-experts MLP: a softmax top-k router and SwiGLU experts that run only on their tokens.

Each expert is an ``ExpertMLP`` of ordinary ``Linear`` layers, so its weights load and serve in every format a
dense linear has (packed float32 or bfloat16 panels, int8 blocks, a GGUF file's blocks). The router's weight
is a plain parameter in the activations' dtype: the routing decision is never made from quantized weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.linear import Linear, MergedLinear


class Routing(NamedTuple):
    """Each token's ``top_k`` experts ``[T, top_k]`` (int64) and their float32 weights ``[T, top_k]``."""

    experts: torch.Tensor
    weights: torch.Tensor


class TopKRouter(nn.Module):
    """Softmax over the ``num_experts`` router logits in float32, then the ``top_k`` largest probabilities;
    with ``renormalize`` they are divided by their sum (Mixtral always, Qwen3-MoE with ``norm_topk_prob``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> Routing:  # [T, hidden]
        probs = F.linear(x, self.weight).float().softmax(dim=-1)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(experts, weights)


class ExpertMLP(nn.Module):
    """One expert: ``down(silu(gate x) * up x)``, gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """``sum_k w_k expert_{e_k}(x)`` over each token's routed experts.

    The step's (token, expert) pairs are sorted by expert; each expert that got tokens multiplies all of its
    rows in one batched matmul per projection, and the weighted rows are added back to their tokens. An expert
    no token chose costs nothing. The module names (``gate``, ``experts.N.{gate_up,down}_proj``) are the
    checkpoints' (Qwen3-MoE's; Mixtral's through its model's renames).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize)
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        routing = self.gate(x)
        top_k = routing.experts.shape[1]
        # NOTE: the stable sort keeps each expert's rows in token order, and a token's contributions are
        # added in ascending expert order.
        order = routing.experts.flatten().argsort(stable=True)  # [T * k]: (token, slot) pairs by expert
        counts = torch.bincount(routing.experts.flatten(), minlength=len(self.experts)).tolist()
        tokens = order // top_k  # [T * k]: the token of each sorted pair
        rows = x.index_select(0, tokens)  # [T * k, hidden]
        out_rows = torch.empty_like(rows)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                out_rows[start:start + count] = expert(rows[start:start + count])
                start += count
        out_rows *= routing.weights.flatten().index_select(0, order).unsqueeze(-1).to(out_rows.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out_rows)
