"""EngineConfig: the frozen settings of one engine."""

from __future__ import annotations

import os
from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_BACKENDS = ("auto", "torch", "cpu", "triton")

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # bytes
DEFAULT_GPU_MEMORY_UTILIZATION = 0.85  # fraction of free device memory for the KV cache


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine; every field has a default that suits the bundled model on CPU.

    ``kv_cache_memory`` (bytes) and ``num_blocks`` size the KV cache; give at most one.
    With neither, the cache takes 1 GiB on CPU and a fraction of free memory on GPU.
    """

    model: str | None = None  # HF directory or .gguf path; None = the bundled SmolLM2
    # "auto" picks the fastest dtype that keeps outputs correct on the device (float32 on CPU). On a
    # CPU without bfloat16 arithmetic, "bfloat16" keeps bfloat16 weights and computes in float32.
    dtype: str = "auto"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # "torch" | "cpu" | "triton"; auto = triton on CUDA, cpu (else torch) on CPU
    max_queued_requests: int = 4096  # admission limit: waiting requests
    max_queued_tokens: int = 4_000_000  # admission limit: prompt tokens of waiting requests
    seed: int = 0

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, _DTYPES)
        _check_choice("device", self.device, _DEVICES)
        _check_choice("attention_backend", self.attention_backend, _BACKENDS)
        _check_int("block_size", self.block_size, 1, 1024)
        _check_int("max_num_seqs", self.max_num_seqs, 1, 1 << 16)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 24)
        _check_int("max_queued_requests", self.max_queued_requests, 1, 1 << 30)
        _check_int("max_queued_tokens", self.max_queued_tokens, 1, 1 << 40)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1, 1 << 24)
        if self.kv_cache_memory is not None and self.num_blocks is not None:
            raise ValueError("give kv_cache_memory or num_blocks, not both")
        if self.kv_cache_memory is not None:
            _check_int("kv_cache_memory", self.kv_cache_memory, 1, 1 << 50)
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks, 1, 1 << 32)
        _check_int("seed", self.seed, 0, (1 << 63) - 1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool; got {type(self.enable_prefix_caching).__name__}")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a path or None; got {type(self.model).__name__}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer; got {type(value).__name__}")
    if not low <= value <= high:
        shown = value if abs(value) < 10**30 else "a number out of range"
        raise ValueError(f"{name} must be in [{low}, {high}]; got {shown}")
