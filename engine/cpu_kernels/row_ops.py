"""The row-wise kernels' wrappers: a decoder layer's element-wise parts (``elementwise.c``) and a step's
logits, greedy argmax (``argmax.c``) and structured output's token masks (``token_mask.c``)."""

from __future__ import annotations

import torch

from engine.cpu_kernels._operands import as_int64, as_rows, check_float32_cpu
from engine.cpu_kernels.build import library, loaded


def serves(x: torch.Tensor) -> bool:
    """Whether the element-wise kernels take ``x``: a float32 CPU tensor, with the library built."""
    return x.dtype == torch.float32 and x.is_cpu and library() is not None


def position_error(num_positions: int) -> IndexError:
    """The error of ``rotary``'s status: a position outside its table."""
    return IndexError(f"a position is outside the rotary table's {num_positions} positions")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(x + residual) * weight, x + residual)`` of ``[T, N]`` rows; without a residual,
    ``(rms_norm(x) * weight, None)``. Outputs are contiguous."""
    lib = loaded()
    for name, t in (("x", x), ("weight", weight), ("residual", residual if residual is not None else x)):
        check_float32_cpu(name, t)
    rows, n = x.shape
    x, ld_x = as_rows(x)
    out = torch.empty(rows, n)
    if residual is None:
        residual_out = None
        residual_ptr = residual_out_ptr = ld_r = 0
    else:
        residual, ld_r = as_rows(residual)
        residual_out = torch.empty(rows, n)
        residual_ptr, residual_out_ptr = residual.data_ptr(), residual_out.data_ptr()
    lib.rms_norm_f32(
        x.data_ptr(), ld_x, residual_ptr, ld_r, weight.contiguous().data_ptr(), rows, n, eps, out.data_ptr(),
        residual_out_ptr, n,
    )
    return out, residual_out


def rotary(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin: torch.Tensor,  # [max_position, rot]: cos of the rot / 2 frequencies, then their sin
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding ("rotate half" form) of the first ``rot`` columns of each head; contiguous outputs.

    Raises:
        IndexError: a position outside ``cos_sin``'s rows (nothing is written).
    """
    lib = loaded()
    rows, num_heads, head_dim = q.shape
    num_kv_heads, rot = k.shape[1], cos_sin.shape[1]
    if rot > head_dim or rot % 2:
        raise ValueError(f"rotary needs an even rotary dim <= head_dim; got {rot} and {head_dim}")
    for name, t in (("q", q), ("k", k), ("cos_sin", cos_sin)):
        check_float32_cpu(name, t)
    q2, ld_q = as_rows(q)
    k2, ld_k = as_rows(k)
    q_out, k_out = torch.empty(rows, num_heads, head_dim), torch.empty(rows, num_kv_heads, head_dim)
    status = lib.rotary_f32(
        q2.data_ptr(), ld_q, k2.data_ptr(), ld_k, as_int64(positions).data_ptr(),
        cos_sin.contiguous().data_ptr(), cos_sin.shape[0], rows, num_heads, num_kv_heads, head_dim, rot,
        q_out.data_ptr(), num_heads * head_dim, k_out.data_ptr(), num_kv_heads * head_dim,
    )
    if status:
        raise position_error(cos_sin.shape[0])
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` rows ``[T, 2I]``; the output is contiguous."""
    lib = loaded()
    check_float32_cpu("x", x)
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"silu_and_mul needs an even width; got {width}")
    x, ld_x = as_rows(x)
    out = torch.empty(rows, width // 2)
    lib.silu_and_mul_f32(x.data_ptr(), ld_x, rows, width // 2, out.data_ptr(), width // 2)
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The int64 index of each row's first largest value (a NaN counting as the largest, as in
    ``torch.argmax``) of ``logits`` ``[R, V]``: float32 CPU rows, any leading dimension, ``V >= 1``."""
    check_float32_cpu("logits", logits)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [rows, vocab] with vocab >= 1; got {list(logits.shape)}")
    logits, ld = as_rows(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    loaded().argmax_rows_f32(logits.data_ptr(), ld, logits.shape[0], logits.shape[1], out.data_ptr())
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets to ``-inf``, in place, the logits of ``rows`` whose bit in ``bitmask`` is 0.

    Args:
        logits: ``[R, V]`` float32 CPU rows (row-major, any leading dimension).
        bitmask: ``[R', ceil(V / 32)]`` int32, contiguous; row ``r`` of the logits takes row ``r``.
        rows: The rows to mask, each below ``min(R, R')``.
    """
    check_float32_cpu("logits", logits)
    num_rows, vocab = logits.shape
    words = (vocab + 31) // 32
    if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.shape[1] != words:
        raise ValueError(f"bitmask must be a contiguous int32 tensor of {words} words a row; got {bitmask.dtype} {tuple(bitmask.shape)}")
    if rows and not 0 <= min(rows) <= max(rows) < min(num_rows, bitmask.shape[0]):
        raise IndexError(f"rows must be in [0, {min(num_rows, bitmask.shape[0])})")
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous")
    index = torch.tensor(rows, dtype=torch.int64)
    loaded().apply_token_bitmask_f32(
        logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), words, index.data_ptr(), len(rows), vocab
    )
