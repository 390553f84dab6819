"""The per-step state that every attention layer reads, scoped to one forward pass."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from engine.layers.attention import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata


_context: ForwardContext | None = None


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    """Make ``context`` visible to the layers for the duration of one forward pass."""
    global _context
    previous, _context = _context, context
    try:
        yield
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("no forward context: call the model inside set_forward_context()")
    return _context
