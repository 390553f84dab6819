"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from engine import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: statistics in float32, scale applied in the input dtype (transformers' order).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or ``(norm(x + residual), x + residual)``; float32 CPU rows take the C kernel, and so do
        the heads of ``[T, H, D]`` (a per-head norm, as ``DecoderPlan`` runs it)."""
        if cpu_kernels.serves(x) and (x.dim() == 2 or (x.dim() == 3 and residual is None)):
            out, residual_out = cpu_kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps, residual)
            return out.view(x.shape) if residual is None else (out, residual_out)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint's ``weight`` w scales by ``1 + w``, the whole computed in float32 and cast
    back (transformers' ``GemmaRMSNorm``); fused with a residual add as ``RMSNorm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if cpu_kernels.serves(x) and (x.dim() == 2 or (x.dim() == 3 and residual is None)):
            scale = 1.0 + self.weight.float()
            out, residual_out = cpu_kernels.rms_norm(x.reshape(-1, x.shape[-1]), scale, self.eps, residual)
            return out.view(x.shape) if residual is None else (out, residual_out)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
