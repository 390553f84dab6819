"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's decoder with sparse mixtures of experts in the layers the config names."""

from __future__ import annotations

from engine.layers.moe import SparseMoeBlock
from engine.models.mixtral import check_silu
from engine.models.qwen import Qwen3ForCausalLM


def is_sparse_layer(config, index: int) -> bool:
    """Whether layer ``index`` has experts: not in ``mlp_only_layers``, and every ``decoder_sparse_step``-th."""
    return (
        index not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (index + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """The sparse layers' MLP is a ``SparseMoeBlock`` of ``num_experts`` experts of ``moe_intermediate_size``,
    ``num_experts_per_tok`` a token, the top-k weights renormalized where ``norm_topk_prob``; the other layers keep
    the dense MLP of ``intermediate_size``. Built on the meta device, as ``MixtralForCausalLM``."""

    def __init__(self, config) -> None:
        check_silu(config)
        super().__init__(config)
        for index, layer in self.model.held_layers():
            if is_sparse_layer(config, index):
                layer.mlp = SparseMoeBlock(
                    config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
                    renormalize=bool(config.norm_topk_prob),
                )
