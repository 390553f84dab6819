"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's norms (``1 + weight``, float32), a norm on each
block's output as well as its input, scaled embeddings, gelu-tanh MLPs, ``query_pre_attn_scalar``, soft-capped
attention scores (Gemma 2) and logits, and sliding and full layers (``layer_types``); Gemma 3 adds q/k norms and
rope per layer type (``rope_parameters["sliding_attention"]``, ``["full_attention"]``)."""

from __future__ import annotations

from dataclasses import replace

from engine.layers.norm import GemmaRMSNorm
from engine.models.llama import DecoderSpec, LlamaForCausalLM


class Gemma2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config) -> DecoderSpec:
        return replace(
            super().decoder_spec(config),
            norm=GemmaRMSNorm,
            sandwich_norms=True,
            query_scale=config.query_pre_attn_scalar**-0.5,
            attn_logit_softcap=getattr(config, "attn_logit_softcapping", None),
            embed_scale=config.hidden_size**0.5,
            final_logit_softcap=getattr(config, "final_logit_softcapping", None),
        )


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
