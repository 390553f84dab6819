"""Run the bfloat16 kernels on one path: each path a CPU has is tested on it, whatever it would choose."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from engine import cpu_kernels

PATHS = cpu_kernels.BF16_LINEAR_PATHS


@contextlib.contextmanager
def bf16_path(name: str) -> Iterator[None]:
    """Cap the bfloat16 linear path at ``name`` (``pytest.skip`` where this CPU lacks it), restored after;
    ``widened`` caps the attention kernel's shared keys at float32 too, so that nothing multiplies bfloat16."""
    lib = cpu_kernels.library()
    lib.linear_bf16_limit(PATHS.index(name))
    if name == "widened":
        lib.attention_bf16_limit(0)
    try:
        if cpu_kernels.bf16_linear_path(256) != name:
            pytest.skip(f"this CPU has no {name} path")
        yield
    finally:
        lib.linear_bf16_limit(len(PATHS) - 1)
        lib.attention_bf16_limit(len(cpu_kernels.BF16_ATTENTION_PATHS) - 1)


@contextlib.contextmanager
def attention_path(name: str, head_dim: int = 64) -> Iterator[None]:
    """Cap the path of shared keys in a bfloat16 cache at ``name`` (``pytest.skip`` where this CPU lacks it)."""
    lib, paths = cpu_kernels.library(), cpu_kernels.BF16_ATTENTION_PATHS
    lib.attention_bf16_limit(paths.index(name))
    try:
        if cpu_kernels.bf16_attention_path(head_dim) != name:
            pytest.skip(f"this CPU has no {name} attention path for head_dim {head_dim}")
        yield
    finally:
        lib.attention_bf16_limit(len(paths) - 1)
