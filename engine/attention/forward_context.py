"""The per-step state that every attention layer reads, scoped to one forward pass."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

from engine.attention.backend import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: tuple[AttentionMetadata, ...]  # per KV cache group; a layer reads its group's


# NOTE: a ContextVar, not a module global: engines in different threads of one process
# each see only their own step.
_context: ContextVar[ForwardContext | None] = ContextVar("forward_context", default=None)


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    """Make ``context`` visible to the layers for the duration of one forward pass."""
    token = _context.set(context)
    try:
        yield
    finally:
        _context.reset(token)


def get_forward_context() -> ForwardContext:
    context = _context.get()
    if context is None:
        raise RuntimeError("no forward context: call the model inside set_forward_context()")
    return context
