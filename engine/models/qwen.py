"""Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each q/k head): the Llama decoder with two flags."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
