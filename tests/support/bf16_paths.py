"""Run the bfloat16 linear kernels on one path: each path a CPU has is tested on it, whatever it would choose."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from engine import cpu_kernels

PATHS = cpu_kernels.BF16_LINEAR_PATHS


@contextlib.contextmanager
def bf16_path(name: str) -> Iterator[None]:
    """Cap the bfloat16 linear path at ``name`` (``pytest.skip`` where this CPU lacks it), restored after."""
    lib = cpu_kernels.library()
    lib.linear_bf16_limit(PATHS.index(name))
    try:
        if cpu_kernels.bf16_linear_path(256) != name:
            pytest.skip(f"this CPU has no {name} path")
        yield
    finally:
        lib.linear_bf16_limit(len(PATHS) - 1)
