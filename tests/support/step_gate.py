"""Ordering a test's events by the engine's state, not by the clock: hold the driver once a request has a token.

``hold_after_first_token`` wraps the ``AsyncEngine``'s documented fault site
``runner.execute_model``: before the first step at which some request has generated a token,
the driver thread stops there until the test releases it. While it is held no request
progresses, so an abort, a cancellation or a timeout the test causes meanwhile lands on a
request that has started and cannot have finished, however busy the machine is.

Example:
    async with hold_after_first_token(engine) as gate:
        task = asyncio.ensure_future(consume(engine.generate(prompt, LONG)))
        await gate.wait_held()        # the request has a token; the driver waits
        task.cancel()                 # its Abort is queued before the next step
    # leaving the block releases the driver
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

__all__ = ["StepGate", "hold_after_first_token", "hold_driver", "wait_until"]

_WAIT_S = 60.0  # how long a test waits for the engine to reach a state before it fails


class StepGate:
    """The hold: ``held`` is set once the driver waits; ``release()`` lets it (and every later step) go on."""

    def __init__(self, then: Callable[[Any], None] | None = None) -> None:
        self.held = threading.Event()
        self._released = threading.Event()
        self._then = then

    def before_step(self, engine: Any) -> None:
        """Driver thread: at the first step after a request has a token, run ``then`` or hold until released."""
        if self.held.is_set() or self._released.is_set():
            return
        if not any(r.num_output_tokens > 0 for r in engine.scheduler.requests.values()):
            return
        self.held.set()
        if self._then is not None:
            self._then(engine)
            self._released.set()
            return
        self._released.wait(_WAIT_S)

    async def wait_held(self) -> None:
        """Waits until the driver holds (a request has a generated token).

        Raises:
            TimeoutError: no request produced a token within a minute.
        """
        if not await asyncio.to_thread(self.held.wait, _WAIT_S):
            raise TimeoutError("no request produced a token")

    def release(self) -> None:
        """Lets the driver go on; the gate never holds again."""
        self._released.set()


@contextlib.asynccontextmanager
async def hold_after_first_token(
    engine: Any, then: Callable[[Any], None] | None = None
) -> AsyncIterator[StepGate]:
    """Holds ``engine``'s driver (an ``AsyncEngine``) before the first step after a request has a token.

    Args:
        engine: the ``AsyncEngine``.
        then: instead of holding, run this on the driver thread with the ``Engine`` at that point
            (e.g. to break the scheduler there), once.

    Yields:
        The ``StepGate``; leaving the block releases it.
    """
    gate = StepGate(then)
    inner = engine.engine
    runner = inner.runner
    had_own = "execute_model" in vars(runner)
    real = runner.execute_model

    def gated(*args: Any, **kwargs: Any) -> Any:
        gate.before_step(inner)
        return real(*args, **kwargs)

    # NOTE: the driver looks ``runner.execute_model`` up on every step: the swap lands between two.
    runner.execute_model = gated
    try:
        yield gate
    finally:
        gate.release()
        if had_own:
            runner.execute_model = real
        else:
            del runner.execute_model


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Polls ``condition`` (engine state read from the caller's side) until it holds.

    Raises:
        TimeoutError: naming ``what``, after a minute.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _WAIT_S
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(f"waited a minute for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def hold_driver(engine: Any) -> AsyncIterator[None]:
    """Holds ``engine``'s driver thread (an ``AsyncEngine``) in a ``call`` for the block: nothing steps or is drained.

    Entering returns once the driver holds, so whatever the block posts waits in the inbox.
    """
    entered, released = threading.Event(), threading.Event()

    def hold(_engine: Any) -> None:
        entered.set()
        released.wait(_WAIT_S)

    call = asyncio.ensure_future(engine.call(hold))
    try:
        if not await asyncio.to_thread(entered.wait, _WAIT_S):
            raise TimeoutError("the driver never took the hold")
        yield
    finally:
        released.set()
        await call
