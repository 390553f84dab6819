"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.errors import ModelLoadError


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of ``[gate | up]`` rows; float32 CPU rows take the C kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
        if x.dim() == 2 and cpu_kernels.serves(x):
            return cpu_kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` of ``[gate | up]`` rows (Gemma's ``gelu_pytorch_tanh``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
}


def gated_activation(hf_config) -> nn.Module:
    """The gated activation an HF config names (``hidden_activation``, else ``hidden_act``; default SiLU).

    Raises:
        ModelLoadError: an activation not in ``GATED_ACTIVATIONS``.
    """
    name = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None) or "silu"
    if name not in GATED_ACTIVATIONS:
        raise ModelLoadError(f"hidden_act={name!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}")
    return GATED_ACTIVATIONS[name]()
