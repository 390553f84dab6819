"""Rotary position embeddings (the non-interleaved "rotate half" form): default, linear, Llama-3 and LongRoPE
frequencies, over a whole head or its first ``partial_rotary_factor``, per layer type where a config gives them
so (Gemma 3: ``rope_parameters`` keyed by ``sliding_attention`` and ``full_attention``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine import cpu_kernels


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _longrope_inv_freq(base: float, dim: int, factors: list[float]) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between is blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """An HF config's rope parameters: ``layer_type``'s where the config keys them by layer type."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    return params


def rope_inv_freq(hf_config, head_dim: int, layer_type: str | None = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] (float32) for an HF config's rope parameters (LongRoPE: the short
    factors' ones; ``rotary_embedding`` adds the long ones)."""
    params = rope_parameters(hf_config, layer_type)
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = _default_inv_freq(base, dim)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    if rope_type == "longrope":
        return _longrope_inv_freq(base, dim, params["short_factor"])
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, longrope")


def rotary_embedding(hf_config, head_dim: int, layer_type: str | None = None) -> RotaryEmbedding:
    """The ``RotaryEmbedding`` of an HF config's layers (of ``layer_type`` where the config gives rope per type).

    LongRoPE (Phi-3, Phi-4-mini): the positions below ``original_max_position_embeddings`` rotate by the short
    factors, the ones from it on by the long factors, cos and sin both scaled by the attention factor (the
    config's, else ``sqrt(1 + ln(factor) / ln(original))``, ``factor = max_position_embeddings / original``).
    That is what transformers computes for a sequence run a token at a time over its cache; its forward over a
    whole sequence longer than the original length rotates every position by the long factors instead.
    """
    params = rope_parameters(hf_config, layer_type)
    inv_freq = rope_inv_freq(hf_config, head_dim, layer_type)
    max_position = hf_config.max_position_embeddings
    if params.get("rope_type", params.get("type")) != "longrope":
        return RotaryEmbedding(head_dim, inv_freq, max_position)
    original = params.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", max_position
    )
    factor = params.get("factor") or max_position / original
    scaling = params.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    long_inv_freq = _longrope_inv_freq(base, 2 * inv_freq.numel(), params["long_factor"])
    return RotaryEmbedding(
        head_dim, inv_freq, max_position, long_inv_freq=long_inv_freq, long_from=original, scaling=scaling
    )


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k at absolute token positions, from a precomputed cos/sin table.

    Args:
        long_inv_freq: the frequencies of the positions from ``long_from`` on (LongRoPE); None: ``inv_freq``'s.
        scaling: a factor on cos and sin (LongRoPE's attention factor).
    """

    def __init__(
        self,
        head_dim: int,
        inv_freq: torch.Tensor,
        max_position: int,
        *,
        long_inv_freq: torch.Tensor | None = None,
        long_from: int | None = None,
        scaling: float = 1.0,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.numel()
        self.max_position = max_position
        self.inv_freq = inv_freq
        self.long_inv_freq, self.long_from, self.scaling = long_inv_freq, long_from, scaling
        self.cos_sin_cache = None  # [max_position, rotary_dim] set by materialize()

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        # NOTE: the table is computed in float32 on the CPU (as transformers does) and only
        # then cast; a model built on the meta device calls this after its weights load.
        t = torch.arange(self.max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, self.inv_freq)  # [P, rotary_dim // 2]
        if self.long_inv_freq is not None:
            freqs[self.long_from :] = torch.outer(t[self.long_from :], self.long_inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        self.cos_sin_cache = torch.cat([cos, sin], dim=-1).to(device=device, dtype=dtype)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu_kernels.serves(q):  # float32 on CPU: one C call for both
            return cpu_kernels.rotary(positions, q, k, self.cos_sin_cache)
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim // 2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)
