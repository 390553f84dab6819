"""ConversationPins: the KV blocks of live conversations, pinned so that their next turn is served from the cache.

When a stored response finishes, the conversation it ends (its messages and its reply, rendered
as the next turn's prompt will begin) is pinned in the engine (``Transport.pin_prefix``): the
next request that continues it computes only what it adds. A conversation keeps one pin, its
latest response's: continuing it releases the pin before. A pin is released:

- ``superseded``: the conversation went on, and its new response holds the pin;
- ``ttl``: ``pin_ttl_s`` passed since it was made;
- ``budget``: pins may hold at most ``pin_max_fraction`` of the KV cache, and always leave room for one
  request of ``max_model_len`` tokens; the oldest make room;
- ``pressure``: requests have been waiting to be admitted at two checks in a row (``TICK_S`` apart):
  every pin goes, so that no pin can keep a request out of a full KV cache;
- ``deleted`` / ``dropped``: its response was deleted, or left the store (age, size);
- ``closed``: the client closed.

A released pin's blocks stay cached (evictable) until their space is needed. A pin still
computing is released once it is computed, never abandoned half-made (that would leak it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sdk.responses.config import ResponsesConfig
from sdk.transport import PrefixPin, Transport

logger = logging.getLogger(__name__)

TICK_S = 0.25  # seconds between checks of the pins' ages and of requests waiting
RELEASE_REASONS = ("superseded", "ttl", "budget", "pressure", "deleted", "dropped", "closed")


@dataclass(eq=False)
class _Pin:
    key: tuple[str, str]
    transport: Transport
    task: asyncio.Future[PrefixPin]
    num_tokens: int
    expires: float


class ConversationPins:
    """The pins of one engine's conversations, keyed like the store: ``(tenant, response id)``.

    Args:
        config: ``pin_ttl_s`` and ``pin_max_fraction``; None = ``ResponsesConfig()``.
        clock: monotonic seconds, for the pins' ages.
    """

    def __init__(self, config: ResponsesConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or ResponsesConfig()
        self._clock = clock
        self._pins: OrderedDict[tuple[str, str], _Pin] = OrderedDict()  # oldest first
        self._releasing: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._waiting = False  # requests were waiting at the last check
        self.released: Counter[str] = Counter()
        """Pins released, by reason (``RELEASE_REASONS``)."""

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    @property
    def num_tokens(self) -> int:
        """Tokens of the pinned conversations."""
        return sum(pin.num_tokens for pin in self._pins.values())

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._pins

    def pin(
        self, key: tuple[str, str], transport: Transport, token_ids: list[int], cache_salt: str | None, capacity: int,
        reserve: int = 0,
    ) -> None:  # fmt: skip
        """Start pinning ``token_ids`` for the conversation of ``key`` (on the running loop).

        Args:
            capacity: tokens the engine's KV cache holds; pins keep within ``pin_max_fraction`` of it.
            reserve: tokens pins always leave free: the room of the longest request, which the engine
                would cut short if pins held it while nothing else runs.
        """
        budget = min(int(self.config.pin_max_fraction * capacity), capacity - reserve)
        if self.config.pin_ttl_s == 0 or len(token_ids) > budget:
            return
        while self._pins and self.num_tokens + len(token_ids) > budget:
            self.release(next(iter(self._pins)), "budget")
        task = asyncio.ensure_future(transport.pin_prefix(token_ids, cache_salt))
        task.add_done_callback(functools.partial(self._pinned, key))
        self._pins[key] = _Pin(key, transport, task, len(token_ids), self._clock() + self.config.pin_ttl_s)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch())

    async def ready(self, key: tuple[str, str]) -> None:
        """Wait until the pin of ``key`` (if it has one) is computed: a continuation then finds it cached."""
        pin = self._pins.get(key)
        if pin is not None:
            await asyncio.wait((pin.task,))

    def release(self, key: tuple[str, str], reason: str) -> None:
        """Release the pin of ``key``, if it has one (once computed, if it still computes)."""
        pin = self._pins.pop(key, None)
        if pin is None:
            return
        self.released[reason] += 1
        task = asyncio.ensure_future(_unpin(pin))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def sweep(self) -> None:
        """Release the pins past their time, and every pin when requests were waiting at this check and the last."""
        now = self._clock()
        for key in [key for key, pin in self._pins.items() if pin.expires <= now]:
            self.release(key, "ttl")
        if not self._pins:
            self._waiting = False
            return
        waited, self._waiting = self._waiting, bool(next(iter(self._pins.values())).transport.stats().get("num_requests_waiting"))
        if waited and self._waiting:
            for key in list(self._pins):
                self.release(key, "pressure")

    async def aclose(self) -> None:
        """Release every pin and wait for their release; stop watching."""
        for key in list(self._pins):
            self.release(key, "closed")
        await self.stop()
        if self._releasing:
            await asyncio.wait(self._releasing)

    async def stop(self) -> None:
        """Stop watching the pins (they die with their engine): for an engine that is shutting down."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None

    def _pinned(self, key: tuple[str, str], task: asyncio.Future[PrefixPin]) -> None:
        """A pin that failed (the engine refused it, or restarted) holds nothing: it is forgotten."""
        if task.cancelled() or task.exception() is None:
            return
        logger.warning("responses: pinning a conversation failed: %r", task.exception())
        pin = self._pins.get(key)
        if pin is not None and pin.task is task:
            del self._pins[key]

    async def _watch(self) -> None:
        while self._pins:
            await asyncio.sleep(TICK_S)
            self.sweep()


async def _unpin(pin: _Pin) -> None:
    await asyncio.wait((pin.task,))
    if pin.task.cancelled() or pin.task.exception() is not None:
        return
    with contextlib.suppress(Exception):  # NOTE: an engine that restarted or shut down has no pins left
        await pin.transport.unpin_prefix(pin.task.result().pin_id)

