"""Picking the attention backend for a device, a dtype and a layer's head shapes."""

from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.attention.backend import AttentionBackend
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype, *, num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int,
) -> AttentionBackend:
    """The backend called ``name`` for layers of ``num_heads`` query and ``num_kv_heads`` KV heads of
    ``head_dim`` over a cache of ``block_size``-token blocks.

    ``"auto"`` picks Triton on CUDA; on CPU the C decode kernel (``"cpu"``) when it builds
    here and handles the dtype and shapes, else plain PyTorch (``"torch"``).

    Raises:
        ValueError: an unknown name, or a backend that cannot serve this device, dtype or shape.
        ModuleNotFoundError: the Triton backend without Triton installed (the ``gpu`` extra).
    """
    kernel_ok = device.type == "cpu" and cpu_kernels.supports(num_heads, num_kv_heads, head_dim, block_size, dtype)
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            name = "cpu" if kernel_ok and cpu_kernels.library() is not None else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if not kernel_ok:
            raise ValueError(
                f"the cpu attention backend needs float32 on a CPU device, head_dim a multiple of 8 and at most "
                f"{cpu_kernels.MAX_HEAD_DIM}, at most {cpu_kernels.MAX_GROUP} query heads per KV head and "
                f"block_size <= {cpu_kernels.MAX_BLOCK_SIZE}; got {dtype} on {device}, {num_heads} query / "
                f"{num_kv_heads} KV heads of {head_dim}, block_size {block_size}"
            )
        if cpu_kernels.library() is None:
            raise ValueError("the cpu attention backend could not compile its kernel here (see the log)")
        return CpuAttentionBackend(num_heads // num_kv_heads)
    if name == "triton":
        if device.type != "cuda":
            raise ValueError(f"the triton attention backend needs a CUDA device, got {device}")
        try:
            from engine.attention.triton_backend import TritonAttentionBackend  # lazy: imports triton
        except ModuleNotFoundError as exc:
            if exc.name != "triton":
                raise
            raise ModuleNotFoundError("the triton attention backend needs Triton: pip install 'paged[gpu]'",
                                      name="triton") from exc
        return TritonAttentionBackend()
    raise ValueError(f"attention backend must be auto, torch, cpu or triton; got {name!r}")
