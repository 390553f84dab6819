"""Self-healing: the driver thread that restarts a dead engine, when it does, and when it gives up.

``AsyncEngine`` supervises its own driver thread (``Supervisor``). A driver that dies (an
exception outside the per-step isolation: the scheduler, the driver loop itself, a
``BaseException`` from the model) keeps the requests in flight to resume (``engine.resume``;
with ``RestartPolicy.resume`` off, or ``n > 1``, they fail with ``EngineRestarting``),
drops the dead ``Engine`` (its KV cache and weights are freed) and starts a fresh one from the
same configuration, which re-queues the kept requests as continuations of what their callers
received: their streams go on. Requests that arrive meanwhile fail fast with the retryable
``EngineRestarting``.
Each engine is one generation; a command posted to an older generation than the one serving
is answered with ``EngineRestarting``, never run on the fresh engine. Each death, and each
fresh start that fails, is a failure: the delay before the next start doubles with the
failures of the last ``window_s`` seconds, and one failure past ``max_restarts`` within the
window leaves the engine dead (every call then raises ``EngineError``).

The fresh engine loads its weights again rather than reusing the dead one's: whatever killed
the driver may have left any of its state (the model's buffers, device graphs) unusable, and
a fresh load is the one state known to be good. It gets as many KV blocks as the first engine
resolved, and the dead engine's memory is released before it loads. With ``kv_cache_dir`` set
it loads the blocks the dead engine last saved there (every ``kv_cache_save_interval_s``);
the dead engine itself saves nothing. A shut-down engine is closed on the driver thread,
which saves its KV cache.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from engine.admission import Admission
from engine.commands import Channel, Command, Stop
from engine.config import EngineConfig
from engine.driver import Driver
from engine.errors import EngineError, EngineRestarting
from engine.knobs import check_knobs, knob
from engine.resume import Resumption

if TYPE_CHECKING:
    from engine.llm_engine import Engine

logger = logging.getLogger(__name__)

_MIN_RETRY_AFTER_S = 0.1  # the shortest wait EngineRestarting advises

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
    resume: bool = knob(
        True, "Resume the requests in flight at a driver death on the fresh engine; off: they fail with "
        "EngineRestarting.",
    )  # fmt: skip
    max_resumes: int = knob(
        2, "Driver deaths a request may be in flight at and resume with the others; past it, it runs alone among "
        "such suspects, and fails with RequestPoisoned if the driver dies again.", ge=0, le=100,
    )  # fmt: skip

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


class Supervisor:
    """The driver thread: drives the serving engine; when driving dies, fails its requests and starts a fresh one.

    Callers on any thread post commands into ``driver.inbox`` and read where the engine
    stands (``check_alive``, ``failure``, ``health``); the rest runs on its thread.

    Args:
        engine: the first engine, started.
        start: builds a fresh engine (from ``restart_config``).
        policy: when to start one, and when to give up.
        inbox: the commands callers post.
        admission: what the driver releases as requests leave the waiting queue.
        load_s: how long the first engine took to start.
    """

    def __init__(
        self,
        engine: Engine,
        start: Callable[[], Engine],
        policy: RestartPolicy,
        inbox: queue.SimpleQueue[Command],
        admission: Admission,
        load_s: float,
    ) -> None:
        self._start = start
        self._load_s = load_s  # how long the latest engine took to start
        self._engine: Engine | None = engine  # None while a fresh one starts, and once dead
        self._generation = 0  # which engine serves: 0 for the first, +1 per fresh one
        self._crashes = CrashLoop(policy)
        self._restarting = False
        self._ready_by = 0.0  # monotonic time the engine being started should serve by
        self._restarts = 0
        self._last_error: str | None = None
        self._stats: dict[str, Any] = {}
        self._resumption = Resumption(policy.resume, policy.max_resumes)
        self._publish(engine)
        self._dead: EngineError | None = None
        self._stopping = False
        self.driver = Driver(inbox, admission, self._publish, self.restart_error, self._resumption)
        self._thread = threading.Thread(target=self._run, name="paged-engine-driver", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------- callers' side

    @property
    def engine(self) -> Engine:
        """The engine serving now.

        Raises:
            EngineRestarting: a fresh engine is starting.
            EngineError: the engine is dead.
        """
        engine = self._engine
        if engine is None:
            raise self._dead if self._dead is not None else self.restart_error()
        return engine

    @property
    def stats(self) -> dict[str, Any]:
        """The serving engine's ``stats()`` after its latest step, and ``engine_restarts``."""
        return self._stats

    @property
    def is_running(self) -> bool:
        """True while an engine serves: not while a fresh one starts, once dead or shut down."""
        return self._dead is None and not self._restarting and self._thread.is_alive()

    def health(self) -> EngineHealth:
        """Running, restarting, dead or stopped; the restarts so far and the last fatal error."""
        if self._stopping:
            status = "stopped"
        elif self._dead is not None or not self._thread.is_alive():
            status = "dead"
        elif self._restarting:
            status = "restarting"
        else:
            status = "running"
        return EngineHealth(status, self._restarts, self._last_error)

    def check_alive(self) -> int:
        """The generation of the engine serving now.

        Raises:
            EngineRestarting: a fresh engine is starting.
            EngineError: the engine is dead or shut down.
        """
        if self._dead is not None:
            raise self._dead
        if self._stopping:
            raise EngineError("the engine is shut down")
        if self._restarting:
            raise self.restart_error()
        return self._generation

    def channel_failure(self, channel: Channel) -> EngineError | None:
        """Why ``channel``'s request will get no answer; None while one may come.

        NOTE: once an engine took the request, the driver answers it on every path (resumed or
        failed at a death): only a driver thread that ended leaves it unanswered.
        """
        if channel.accepted:
            return self._dead if self._dead is not None and not self._thread.is_alive() else None
        return self.failure(channel.generation)

    def failure(self, generation: int) -> EngineError | None:
        """Why the engine of ``generation`` will not answer any more; None while it serves."""
        if self._dead is not None:
            return self._dead
        if self._restarting or generation != self._generation:
            return self.restart_error()
        return None

    def restart_error(self) -> EngineRestarting:
        """The retryable error of a request the dead engine will not answer, with the time a fresh one should serve by."""
        retry_after = max(_MIN_RETRY_AFTER_S, self._ready_by - time.monotonic())
        return EngineRestarting(
            f"the engine driver died ({self._last_error}) and a fresh engine is starting: retry the request",
            retry_after,
        )

    def stop(self) -> None:
        """Asks the thread to abort every request and end (a restart in progress ends first); idempotent."""
        if not self._stopping:
            self._stopping = True
            self.driver.inbox.put(Stop())

    def join(self) -> None:
        """Waits for the thread to end."""
        self._thread.join()

    # ---------------------------------------------------------------------------- driver thread

    def _run(self) -> None:
        """Drives the engine; when driving dies, fails its requests and starts a fresh engine."""
        try:
            while True:
                try:
                    self.driver.drive(self.engine, self._generation)
                    self._close(self.engine)
                    return  # shut down
                except BaseException as exc:  # noqa: BLE001 - whatever killed the drive, a fresh engine takes over
                    self._record(exc, "the engine driver died")
                if not self._recover():
                    return
        except BaseException as exc:  # noqa: BLE001 - the supervisor itself failed: nothing restarts
            self._record(exc, "the engine supervisor died")
            self._dead = EngineError(f"the engine supervisor died ({self._last_error})")
        finally:
            if self._dead is None:
                self._dead = EngineError("the engine is shut down")
            dead = self._dead
            self.driver.fail(lambda: dead)

    def _close(self, engine: Engine) -> None:
        """Closes the engine shut down (it saves its KV cache where ``kv_cache_dir`` is set); a failure is logged.

        NOTE: a dead engine is never closed: whatever killed it may have left its KV unusable.
        """
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - the shutdown goes on; the directory keeps its last save
            logger.exception("closing the engine failed")

    def _record(self, exc: BaseException, what: str) -> None:
        self._last_error = describe(exc)
        logger.error("%s: %s", what, self._last_error, exc_info=exc)
        forget_frames(exc)

    def _recover(self) -> bool:
        """After driving died: fail its requests, drop the dead engine, start a fresh one.

        Returns:
            True once a fresh engine serves; False to stop (shut down, or dead: ``_dead`` set).
        """
        self._restarting = True  # NOTE: first, so callers fail fast from here on
        self._engine = None  # the dead engine's KV cache and weights go with its last reference
        self.driver.suspend(self.restart_error)
        while True:
            delay = None if self._stopping else self._crashes.next_delay(time.monotonic())
            if delay is None:
                if not self._stopping:
                    policy = self._crashes.policy
                    why = "restarts are off" if policy.max_restarts == 0 else (
                        f"more than {policy.max_restarts} failures within {policy.window_s:g} s"
                    )  # fmt: skip
                    self._dead = EngineError(f"the engine driver died ({self._last_error}); not restarted: {why}")
                    logger.error("the engine is dead: %s", why)
                return False
            self._ready_by = time.monotonic() + delay + self._load_s
            self.driver.fail_pins(self.restart_error)
            logger.warning("starting a fresh engine in %.2f s", delay)
            if not self._wait_out(delay):
                return False
            self._restarts += 1
            self._stats = {**self._stats, "engine_restarts": self._restarts}
            release_memory()  # the dead engine's, or a failed start's
            started = time.monotonic()
            try:
                engine = self._start()
            except BaseException as exc:  # noqa: BLE001 - a failed start counts as one more failure
                self._record(exc, "a fresh engine failed to start")
                continue
            self._load_s = time.monotonic() - started
            self._engine = engine
            self._generation += 1
            self.driver.resume(engine, self._generation)
            self._publish(engine)  # NOTE: after the resume, before callers see the engine serve
            self._restarting = False
            logger.warning("a fresh engine serves (restart %d, started in %.2f s)", self._restarts, self._load_s)
            return not self._stopping

    def _wait_out(self, delay: float) -> bool:
        """Waits ``delay`` seconds on the inbox, answering what arrives with ``EngineRestarting``; False on shutdown."""
        inbox = self.driver.inbox
        until = time.monotonic() + delay
        while not self._stopping:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return True
            try:
                command = inbox.get(timeout=remaining)
            except queue.Empty:
                return True
            self.driver.refuse(command, self.restart_error())
        return False

    def _publish(self, engine: Engine) -> None:
        stats = engine.stats()
        stats["engine_restarts"] = self._restarts
        stats["requests_resumed"] = self._resumption.num_resumed
        stats["requests_poisoned"] = self._resumption.num_poisoned
        self._stats = stats
