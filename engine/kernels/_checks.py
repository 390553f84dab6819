"""Argument checks shared by the host wrappers: explicit errors before any kernel launch."""

from __future__ import annotations

import functools

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction


def check_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``t`` has ``ndim`` dims, an allowed dtype and ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            raise TypeError(f"{name} must have dtype in {allowed}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_paged_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int, int]:
    """Check a K/V cache pair; returns ``(num_blocks, block_size, num_kv_heads, head_dim)``.

    Both caches must be ``[num_blocks, block_size, num_kv_heads, head_dim]`` with the same
    shape and strides (the kernels take one set of strides for both) and a contiguous last dim.
    """
    check_tensor("key_cache", key_cache, 4, dtype, device)
    check_tensor("value_cache", value_cache, 4, dtype, device)
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError(
            f"key_cache and value_cache must share shape and strides, got "
            f"{tuple(key_cache.shape)}/{key_cache.stride()} and "
            f"{tuple(value_cache.shape)}/{value_cache.stride()}"
        )
    if key_cache.stride(-1) != 1:
        raise ValueError(f"the caches' head_dim must be contiguous, got strides {key_cache.stride()}")
    block_size = key_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return tuple(key_cache.shape)  # type: ignore[return-value]


def check_attention_operands(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, int, int, int]:
    """Check what both attention kernels read: ``q`` [T, Hq, D] against the paged caches, and the block tables;
    returns ``(block_size, num_kv_heads, head_dim, group)``, ``group`` the GQA group size ``Hq // Hkv``."""
    device = q.device
    _, block_size, num_kv_heads, head_dim = check_paged_cache(key_cache, value_cache, q.dtype, device)
    check_tensor("q", q, 3, (torch.float32, torch.float16, torch.bfloat16), device)
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if q.stride(-1) != 1:
        raise ValueError(f"q's head_dim must be contiguous, got strides {q.stride()}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    check_tensor("block_tables", block_tables, 2, torch.int32, device)
    return block_size, num_kv_heads, head_dim, q.shape[1] // num_kv_heads


def check_launchable(kernel: object, device: torch.device) -> None:
    """Fail clearly when a CPU tensor meets a kernel compiled for the GPU."""
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {device}); to run them on the CPU set "
            "TRITON_INTERPRET=1 before engine.kernels is first imported"
        )


def head_block(head_dim: int) -> int:
    """Padded head_dim the kernels tile over (a power of two, at least 16 for ``tl.dot``)."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 dots (tf32 would cost ~1e-3 of accuracy); halves are exact already."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def get_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs one at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
