"""The wrapper of an encoder's bidirectional attention over a packed variable-length batch (``encoder_attention.c``):
every token attends over every token of its own input, float32 or bfloat16, no cache and no padding."""

from __future__ import annotations

import torch

from engine.cpu_kernels._operands import DTYPE_SUFFIX, as_int64
from engine.cpu_kernels.build import BF16_ENCODER_ATTENTION_PATHS, loaded

MAX_ENCODER_HEAD_DIM = 256  # the kernel's MAX_ENCODER_HEAD_DIM


def encoder_supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``encoder_attention`` takes this head_dim and dtype: float32 or bfloat16, head_dim a multiple of 16."""
    return dtype in DTYPE_SUFFIX and head_dim % 16 == 0 and 0 < head_dim <= MAX_ENCODER_HEAD_DIM


def bf16_encoder_attention_path(head_dim: int) -> str:
    """What bfloat16 inputs of this head_dim run on this CPU: one of ``BF16_ENCODER_ATTENTION_PATHS``."""
    return BF16_ENCODER_ATTENTION_PATHS[loaded().encoder_attention_bf16_path(head_dim)]


def encoder_attention(
    q: torch.Tensor,  # [T, H, D] float32 or bfloat16, heads side by side (stride D), elements contiguous
    k: torch.Tensor,  # [T, H, D] as q
    v: torch.Tensor,  # [T, H, D] as q
    cu_seqlens: torch.Tensor,  # [B + 1] int64: input b is tokens cu_seqlens[b] .. cu_seqlens[b + 1]
    scale: float,
) -> torch.Tensor:  # [T, H * D], q's dtype
    """softmax(q k^T * scale) v within each input of the packed batch, the inputs laid end to end."""
    num_tokens, num_heads, head_dim = q.shape
    if not encoder_supports(head_dim, q.dtype):
        raise ValueError(f"unsupported by the CPU encoder attention kernel: head_dim {head_dim}, {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape or t.dtype != q.dtype:
            raise ValueError(f"{name} must match q's shape {tuple(q.shape)} and dtype {q.dtype}; got "
                             f"{tuple(t.shape)} {t.dtype}")  # fmt: skip
    q, k, v = (_rows(t) for t in (q, k, v))
    cu_seqlens = as_int64(cu_seqlens)
    if len(cu_seqlens) == 0 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to the {num_tokens} tokens")
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype)
    kernel = getattr(loaded(), f"encoder_attention_{DTYPE_SUFFIX[q.dtype]}")
    status = kernel(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cu_seqlens.data_ptr(),
        len(cu_seqlens) - 1, num_heads, head_dim, scale, out.data_ptr(), out.stride(0),
    )  # fmt: skip
    if status == -1:
        raise ValueError("cu_seqlens must not decrease")
    if status:
        raise MemoryError("the CPU encoder attention kernel could not allocate its scratch")
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [T, H, D] itself where each token's heads sit side by side with contiguous elements, else a copy."""
    if t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2]) and t.is_cpu:
        return t
    return t.contiguous().cpu()
