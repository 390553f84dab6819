"""The forward context is scoped to one pass and to one thread."""

from __future__ import annotations

import threading

import pytest

from engine.attention.forward_context import ForwardContext, get_forward_context, set_forward_context


def test_scoped_nested_and_per_thread() -> None:
    """Contexts nest and restore; another thread never sees this thread's context."""
    outer, inner = ForwardContext(attn_metadata="outer"), ForwardContext(attn_metadata="inner")
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()
    with set_forward_context(outer):
        with set_forward_context(inner):
            assert get_forward_context() is inner
        assert get_forward_context() is outer
        seen: list[object] = []

        def other_thread() -> None:
            try:
                seen.append(get_forward_context())
            except RuntimeError as e:
                seen.append(e)

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert isinstance(seen[0], RuntimeError)
    with pytest.raises(RuntimeError):
        get_forward_context()
