"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of ``[gate | up]`` rows; float32 CPU rows take the C kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
        if x.dim() == 2 and cpu_kernels.serves(x):
            return cpu_kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
