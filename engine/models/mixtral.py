"""Mixtral: the Llama decoder with a sparse mixture of SwiGLU experts in place of each layer's MLP."""

from __future__ import annotations

from engine.errors import ModelLoadError
from engine.layers.moe import SparseMoeBlock
from engine.models.llama import LlamaForCausalLM


def check_silu(config) -> None:
    """Raises ``ModelLoadError`` unless the experts' activation is SiLU, the only one the experts run."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act={config.hidden_act!r} is not supported for experts; supported: 'silu'")


class MixtralForCausalLM(LlamaForCausalLM):
    """Every layer's MLP is a ``SparseMoeBlock`` of ``num_local_experts`` experts, ``num_experts_per_tok`` a token,
    the top-k weights renormalized to sum to 1. Built on the meta device (as the runner does), the dense MLPs the
    Llama layers start with cost nothing before they are replaced."""

    # our module names -> the checkpoint's (block_sparse_moe.gate, block_sparse_moe.experts.N.w1/w3/w2)
    checkpoint_renames = ((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."),
                          (".down_proj.", ".w2."))

    def __init__(self, config) -> None:
        check_silu(config)
        super().__init__(config)
        for _, layer in self.model.held_layers():
            layer.mlp = SparseMoeBlock(
                config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
                renormalize=True,
            )
