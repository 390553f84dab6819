"""How the op wrappers check their tensor operands and hand them to C: dtypes, rows and index arrays."""

from __future__ import annotations

import torch

DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # of a kernel's name, by the cache's or weight's dtype


def check_float32_cpu(name: str, t: torch.Tensor) -> None:
    """ValueError naming ``name`` unless ``t`` is a float32 CPU tensor."""
    if t.dtype != torch.float32 or not t.is_cpu:
        raise ValueError(f"{name} must be a float32 CPU tensor; got {t.dtype} on {t.device}")


def as_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` [R, F] or [R, H, D] as (tensor, leading dimension) of rows of F = H * D elements: kept when
    each row is one contiguous run, else copied. (No views are made: a step calls this hundreds of times.)"""
    rows, cols = t.shape[0], t.shape[1] * t.shape[2] if t.dim() == 3 else t.shape[1]
    inner = t.stride(-1) == 1 and (t.dim() == 2 or t.shape[1] == 1 or t.stride(1) == t.shape[2])
    if inner and (rows == 1 or t.stride(0) >= cols):
        return t, max(t.stride(0), cols)
    return t.contiguous(), cols


def as_int64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int64 tensor (itself where it is one)."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
