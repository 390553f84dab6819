"""Shared prefixes: ``PrefixHandle``, a prefix pinned in the engine, and ``PinnedPrefixes``, a client's open handles.

``AsyncClient.prefix()`` pins one; each finished request reports its prompt to the client's
``PinnedPrefixes`` (``count_hits``), which credits the handles whose prefix the prompt starts with.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from sdk.closing import AsyncClosing, Closing
from sdk.runtime import Runtime
from sdk.transport import PrefixPin, Transport
from sdk.types import ChatMessage


class PrefixHandle(Closing, AsyncClosing):
    """A shared prefix whose KV blocks stay pinned in the engine while the handle is open.

    Requests whose prompt starts with the prefix's tokens (for a chat prefix: a conversation
    that starts with ``messages``) skip its prefill; ``num_hit_tokens`` counts the tokens they
    were served from the cache. Close it with ``aclose()`` / ``close()`` or a ``with`` block;
    a handle that is garbage-collected unpins too.
    """

    def __init__(self, pin: PrefixPin, messages: list[ChatMessage] | None, transport: Transport, runtime: Runtime) -> None:
        self._transport = transport
        self._runtime = runtime
        self.pin_id = pin.pin_id
        self.token_ids = pin.token_ids
        self.messages = messages
        """The prefix conversation (chat prefixes); start requests with ``[*handle.messages, ...]``."""
        self.num_cached_at_pin = pin.num_cached_tokens
        self.num_requests = 0
        """Requests that started with this prefix."""
        self.num_hit_tokens = 0
        """Prompt tokens of those requests served from the cache, up to the prefix's length."""
        self.closed = False
        self._finalizer = weakref.finalize(self, _unpin_later, runtime, transport, pin.pin_id)
        self._finalizer.atexit = False  # the runtimes shut their engines down at exit anyway

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def matches(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether a prompt starts with this prefix."""
        n = len(self.token_ids)
        return len(prompt_token_ids) >= n and list(prompt_token_ids[:n]) == self.token_ids

    async def aclose(self) -> None:
        """Unpin the prefix; its blocks stay cached (evictable). Idempotent."""
        if not self.closed:
            self.closed = True
            self._finalizer.detach()
            await self._transport.unpin_prefix(self.pin_id)

    def close(self) -> None:
        """Sync ``aclose()`` (runs on the client's runtime loop thread); not for use inside a running event loop."""
        self._runtime.run_sync(self.aclose())

    def __repr__(self) -> str:
        return (
            f"PrefixHandle(num_tokens={self.num_tokens}, num_requests={self.num_requests}, "
            f"num_hit_tokens={self.num_hit_tokens}, closed={self.closed})"
        )


class PinnedPrefixes:
    """A client's open prefix handles (held weakly: a handle collected unpins itself)."""

    def __init__(self) -> None:
        self._handles: weakref.WeakSet[PrefixHandle] = weakref.WeakSet()

    def add(self, handle: PrefixHandle) -> None:
        self._handles.add(handle)

    def count_hits(self, prompt_token_ids: Sequence[int], num_cached_tokens: int) -> None:
        """Credit a finished request to each open handle its prompt starts with."""
        for handle in list(self._handles):
            if not handle.closed and handle.matches(prompt_token_ids):
                handle.num_requests += 1
                handle.num_hit_tokens += min(num_cached_tokens, handle.num_tokens)

    async def aclose(self) -> None:
        """Unpin every open handle."""
        for handle in list(self._handles):
            await handle.aclose()


def _unpin_later(runtime: Runtime, transport: Transport, pin_id: str) -> None:
    if not runtime.closed:  # a closed runtime's own engine is shut down, its pins with it
        runtime.submit(transport.unpin_prefix(pin_id))
