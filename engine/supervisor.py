"""Self-healing: when to start a fresh engine after the driver died, and when to give up.

``AsyncEngine`` supervises its own driver thread. A driver that dies (an exception outside
the per-step isolation: the scheduler, the driver loop itself, a ``BaseException`` from the
model) fails every request in flight with ``EngineRestarting``, drops the dead ``Engine``
(its KV cache and weights are freed) and starts a fresh one from the same configuration;
requests that arrive meanwhile fail fast with the same retryable error. Each death, and each
fresh start that fails, is a failure: the delay before the next start doubles with the
failures of the last ``window_s`` seconds, and one failure past ``max_restarts`` within the
window leaves the engine dead (every call then raises ``EngineError``).

The fresh engine loads its weights again rather than reusing the dead one's: whatever killed
the driver may have left any of its state (the model's buffers, device graphs) unusable, and
a fresh load is the one state known to be good. It gets as many KV blocks as the first engine
resolved, and the dead engine's memory is released before it loads.
"""

from __future__ import annotations

import dataclasses
import gc
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Literal

from engine.config import EngineConfig
from engine.knobs import check_knobs, knob

Status = Literal["running", "restarting", "dead", "stopped"]


@dataclass(frozen=True)
class RestartPolicy:
    """How an ``AsyncEngine`` restarts a driver that died.

    Raises:
        ParameterError: a field of the wrong type or outside its bounds (``param`` names it).
    """

    max_restarts: int = knob(
        3, "Failures (driver deaths and failed starts) restarted within window_s; one more leaves the engine dead. "
        "0 = never restart.", ge=0, le=1000,
    )  # fmt: skip
    window_s: float = knob(60.0, "Seconds over which failures are counted.", gt=0.0, le=86400.0)
    backoff_s: float = knob(
        0.5, "Seconds before the first restart; doubled for each further failure in the window.", ge=0.0, le=600.0
    )
    max_backoff_s: float = knob(10.0, "Longest delay before a restart, in seconds.", ge=0.0, le=3600.0)

    def __post_init__(self) -> None:
        check_knobs(self)


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """Where an engine stands: what ``/health`` reports.

    Attributes:
        status: ``running``; ``restarting`` (the driver died, a fresh engine is starting);
            ``dead`` (it died once too often, or a start failed for good); ``stopped`` (shut down).
        restarts: fresh engines started (or tried) since the first.
        last_error: the exception that last killed the driver or failed a start, as
            ``Type: message`` (at most 200 characters); None while none has.
    """

    status: Status
    restarts: int = 0
    last_error: str | None = None


class CrashLoop:
    """The failures of the last ``window_s`` seconds, and the delay before the next restart."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._failures: deque[float] = deque()

    def next_delay(self, now: float) -> float | None:
        """Records a failure at ``now`` (monotonic seconds).

        Returns:
            Seconds to wait before starting a fresh engine, or None: too many failures within
            the window, give up.
        """
        policy = self.policy
        self._failures.append(now)
        while self._failures[0] <= now - policy.window_s:
            self._failures.popleft()
        num = len(self._failures)
        if num > policy.max_restarts:
            return None
        return min(policy.backoff_s * 2 ** (num - 1), policy.max_backoff_s)


def restart_config(config: EngineConfig, num_blocks: int) -> EngineConfig:
    """The settings a fresh engine starts from: ``config``, with the KV cache size the first engine resolved.

    NOTE: a budget from free memory (the default) would size the fresh cache by what is free
    at restart; the same block count keeps the capacity the operator saw.
    """
    return dataclasses.replace(config, num_blocks=num_blocks, kv_cache_memory=None)


def forget_frames(exc: BaseException | None) -> None:
    """Clears the locals of the frames an exception (and its causes) went through.

    NOTE: the exception may outlive its handler (a caller holds it, a log handler buffers its
    record): its frames would keep the dead ``Engine``, and its KV cache, alive.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def release_memory() -> None:
    """Frees what a dropped engine held (reference cycles included) before a fresh one allocates its own."""
    import torch  # NOTE: here, not at the top: the policy and health types import without torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # NOTE: the caching allocator keeps freed blocks; the fresh engine needs them


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, at most 200 characters (what ``EngineHealth.last_error`` holds)."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text if len(text) <= 200 else text[:199] + "…"
