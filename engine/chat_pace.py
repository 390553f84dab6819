"""ChatPace: whether the chat engines of the process have requests, and how long their steps take.

The engines of a process step in turn (``engine.driver.STEP_LOCK``): a chat model's inter-token latency is
its own step plus whatever the engines beside it run before its next one. A pooling engine beside it
(``PoolingQueue.share_steps``) asks ``turn_seconds()`` how long its turn may run: while a chat engine has
requests, ``pooling_time_fraction`` of that engine's measured step time (the median of its latest steps);
with none, no bound. Each chat driver writes its own entry; any thread reads.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

STEP_WINDOW = 8  # latest steps of a chat engine whose median paces the pooling engines


@dataclass(slots=True)
class _Chat:
    fraction: float
    active: bool = False
    steps: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))  # seconds


class ChatPace:
    """The chat engines' activity and step times, keyed by their driver; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chats: dict[int, _Chat] = {}

    def set_active(self, key: int, active: bool, fraction: float) -> None:
        """Chat engine ``key`` has requests (``active``) or none; ``fraction``: its ``pooling_time_fraction``."""
        with self._lock:
            chat = self._chats.get(key)
            if chat is None:
                if not active:
                    return
                chat = self._chats[key] = _Chat(fraction)
            chat.active, chat.fraction = active, fraction
            if not active:
                chat.steps.clear()  # NOTE: the next burst's steps may be another size: measured afresh

    def observe(self, key: int, seconds: float) -> None:
        """Chat engine ``key`` took ``seconds`` for a step that had requests."""
        with self._lock:
            chat = self._chats.get(key)
            if chat is not None and chat.active:
                chat.steps.append(seconds)

    def forget(self, key: int) -> None:
        """Chat engine ``key`` is gone (its driver ended)."""
        with self._lock:
            self._chats.pop(key, None)

    def turn_seconds(self) -> float | None:
        """Seconds a pooling engine's turn may run: None while no chat engine has requests (no bound), else the
        smallest ``fraction * median step`` of the active ones (0.0 before one of them finished a step: one layer
        a turn)."""
        with self._lock:
            bounds = [
                chat.fraction * statistics.median(chat.steps) if chat.steps else 0.0
                for chat in self._chats.values()
                if chat.active
            ]
        return min(bounds) if bounds else None


CHAT_PACE = ChatPace()
"""The process's chat engines, as their drivers report them (see ``engine.driver.Driver.drive``)."""
