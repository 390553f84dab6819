"""Phi-3 and Phi-4-mini: the Llama decoder; their checkpoints store ``qkv_proj`` and ``gate_up_proj`` fused, as our
modules are (loaded whole), and their rope is LongRoPE over a ``partial_rotary_factor`` of each head
(``engine.layers.rotary``)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    qkv_bias = False
    o_bias = False
