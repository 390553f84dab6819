"""Admission control: how many requests and prompt tokens may wait for the engine, and which request ids are live.

A request holds an admission slot from ``AsyncEngine.generate`` until its first output (it
left the waiting queue) or its end, whichever comes first; past ``max_queued_requests`` or
``max_queued_tokens`` a new one fails at once with ``EngineOverloaded`` rather than queue
without bound. Thread-safe: callers admit on their threads, the driver thread releases.
"""

from __future__ import annotations

import threading

from engine.commands import Channel
from engine.errors import EngineOverloaded, ParameterError


class Admission:
    """The queued requests and prompt tokens under their limits, the live request ids, the requests refused.

    Args:
        max_queued_requests: requests admitted but not yet running, at most.
        max_queued_tokens: their prompt tokens, at most.
    """

    def __init__(self, max_queued_requests: int, max_queued_tokens: int) -> None:
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self._lock = threading.Lock()
        self._queued_requests = 0
        self._queued_tokens = 0
        self._live_ids: set[str] = set()
        self._num_rejected = 0

    @property
    def num_rejected(self) -> int:
        """Requests refused before they reached the engine (bad options or prompt, limits full)."""
        return self._num_rejected

    def admit(self, request_id: str, channel: Channel) -> None:
        """Reserves a slot and ``channel.num_tokens`` queued tokens for ``request_id``.

        Raises:
            ParameterError: ``request_id`` is in use by a live request.
            EngineOverloaded: the queued requests or tokens would pass their limit.
        """
        with self._lock:
            if request_id in self._live_ids:
                raise ParameterError("request_id", f"request id {request_id!r} is already in use")
            if self._queued_requests + 1 > self.max_queued_requests:
                raise EngineOverloaded(f"{self._queued_requests} requests are queued (max_queued_requests)")
            if self._queued_tokens + channel.num_tokens > self.max_queued_tokens:
                raise EngineOverloaded(f"{self._queued_tokens} prompt tokens are queued (max_queued_tokens)")
            self._queued_requests += 1
            self._queued_tokens += channel.num_tokens
            self._live_ids.add(request_id)

    def release(self, channel: Channel) -> None:
        """Frees ``channel``'s slot (its request left the waiting queue); a second release is a no-op."""
        with self._lock:
            if channel.reserved:
                channel.reserved = False
                self._queued_requests -= 1
                self._queued_tokens -= channel.num_tokens

    def end(self, request_id: str, channel: Channel) -> None:
        """The request ended: frees its slot if it still holds one, and its id for reuse."""
        self.release(channel)
        with self._lock:
            self._live_ids.discard(request_id)

    def reject(self) -> None:
        """Counts a request refused before it reached the engine."""
        with self._lock:
            self._num_rejected += 1
