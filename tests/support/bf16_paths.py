"""Run the bfloat16 kernels on one path: each path a CPU has is tested on it, whatever it would choose."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import pytest

from engine import cpu_kernels
from engine.cpu_kernels.build import ENCODER_ATTENTION_CAPS

PATHS = cpu_kernels.BF16_LINEAR_PATHS


@contextlib.contextmanager
def _capped(
    cap: Callable[[int], None], paths: tuple[str, ...], name: str, taken: Callable[[], str], missing: str
) -> Iterator[None]:
    """Cap a kernel's path at ``name`` with ``cap`` (``pytest.skip(missing)`` unless ``taken()`` is then ``name``),
    the highest of ``paths`` restored after."""
    cap(paths.index(name))
    try:
        if taken() != name:
            pytest.skip(missing)
        yield
    finally:
        cap(len(paths) - 1)


@contextlib.contextmanager
def bf16_path(name: str) -> Iterator[None]:
    """Cap the bfloat16 linear path at ``name`` (``pytest.skip`` where this CPU lacks it), restored after;
    ``widened`` caps the attention kernels (the paged one's shared keys, the encoder's) at float32 too, so that
    nothing multiplies bfloat16."""
    lib = cpu_kernels.library()
    with contextlib.ExitStack() as stack:
        taken = functools.partial(cpu_kernels.bf16_linear_path, 256)
        stack.enter_context(_capped(lib.linear_bf16_limit, PATHS, name, taken, f"this CPU has no {name} path"))
        if name == "widened":
            stack.enter_context(attention_path("widened"))
            stack.enter_context(encoder_attention_path("widened"))
        yield


@contextlib.contextmanager
def attention_path(name: str, head_dim: int = 64) -> Iterator[None]:
    """Cap the path of shared keys in a bfloat16 cache at ``name`` (``pytest.skip`` where this CPU lacks it)."""
    cap, paths = cpu_kernels.library().attention_bf16_limit, cpu_kernels.BF16_ATTENTION_PATHS
    missing = f"this CPU has no {name} attention path for head_dim {head_dim}"
    with _capped(cap, paths, name, functools.partial(cpu_kernels.bf16_attention_path, head_dim), missing):
        yield


@contextlib.contextmanager
def encoder_attention_path(name: str, head_dim: int = 32) -> Iterator[None]:
    """Cap the path of an encoder's bfloat16 attention at ``name`` (``pytest.skip`` where this CPU lacks it)."""
    cap, paths = cpu_kernels.library().encoder_attention_bf16_limit, ENCODER_ATTENTION_CAPS  # restored to "auto"
    missing = f"this CPU has no {name} encoder attention path for head_dim {head_dim}"
    with _capped(cap, paths, name, functools.partial(cpu_kernels.bf16_encoder_attention_path, head_dim), missing):
        yield
