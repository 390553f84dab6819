"""Rotary position embeddings (the non-interleaved "rotate half" form) with linear and Llama-3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine import cpu_kernels


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


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


def rope_inv_freq(hf_config, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] (float32) for an HF config's ``rope_parameters``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
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
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k at absolute token positions, from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, inv_freq: torch.Tensor, max_position: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.numel()
        self.max_position = max_position
        self.inv_freq = inv_freq
        self.cos_sin_cache = None  # [max_position, rotary_dim] set by materialize()

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        # NOTE: the table is computed in float32 on the CPU (as transformers does) and only
        # then cast; a model built on the meta device calls this after its weights load.
        t = torch.arange(self.max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, self.inv_freq)  # [P, rotary_dim // 2]
        cos, sin = freqs.cos(), freqs.sin()
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
