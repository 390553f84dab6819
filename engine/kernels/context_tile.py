"""Logit soft-capping inside the attention kernels (Gemma 2): ``cap * tanh(s / cap)``."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)`` elementwise, as ``cap - 2 cap / (exp(2 s / cap) + 1)``; the exponent is
    clamped to [-20, 20], past which tanh is +-1 in float32 and exp would overflow."""
    x = tl.minimum(tl.maximum(s * (2.0 / cap), -20.0), 20.0)
    return cap - 2.0 * cap / (tl.exp(x) + 1.0)
