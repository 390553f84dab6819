"""Fault injection for tests: make one step's forward, the sampler or the scheduler raise on purpose.

An engine without an injected fault runs exactly the code it always runs: the switch wraps
the public attributes the engine documents for this (``runner.execute_model``, ``sampler``,
``scheduler.schedule``) and restores them on exit. Works on an ``Engine`` or an
``AsyncEngine`` (through its documented ``engine`` property).

Example:
    with inject_fault(engine, "sampler", request_id="req-3") as fault:
        engine.generate(...)          # req-3 fails with EngineError; the others finish
    assert fault.num_fired == 1

Sites:
    ``execute_model``  the batched forward (``ModelRunner.execute_model``): every request of
                       the step fails with ``EngineError``; the engine goes on.
    ``sampler``        sampling (``Sampler.__call__``): with ``request_id``, only the rows of
                       that request raise, so it fails alone.
    ``schedule``       ``Scheduler.schedule``, outside any per-step isolation: kills the
                       ``AsyncEngine`` driver loop (a dead engine).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

Site = Literal["execute_model", "sampler", "schedule"]
SITES: tuple[str, ...] = ("execute_model", "sampler", "schedule")


class InjectedFault(RuntimeError):
    """The default error a fault raises; tests match on its message."""


@dataclass
class Fault:
    """When a fault fires, and how often it has.

    Attributes:
        site: where it fires (see the module docstring).
        request_id: fire only for calls that involve this request (its ``n`` siblings
            included); None = any call.
        after: let this many matching calls pass before the first firing.
        times: fire at most this many times; None = every matching call.
        error: what to raise; a fresh ``InjectedFault`` naming the site by default.
        num_calls: matching calls seen so far.
        num_fired: times it raised.
    """

    site: Site
    request_id: str | None = None
    after: int = 0
    times: int | None = 1
    error: BaseException | None = None
    num_calls: int = 0
    num_fired: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.site not in SITES:
            raise ValueError(f"site must be one of {', '.join(SITES)}; got {self.site!r}")
        if self.after < 0 or (self.times is not None and self.times < 0):
            raise ValueError("after and times must be >= 0")

    def maybe_fire(self, req_ids: list[str]) -> None:
        """Raises when this call matches and the fault is due; counts the call either way."""
        if self.request_id is not None and not any(_belongs(r, self.request_id) for r in req_ids):
            return
        with self._lock:
            self.num_calls += 1
            due = self.num_calls > self.after and (self.times is None or self.num_fired < self.times)
            if due:
                self.num_fired += 1
        if due:
            raise self.error if self.error is not None else InjectedFault(f"injected fault in {self.site}")


def _belongs(req_id: str, request_id: str) -> bool:
    # NOTE: the engine names the n > 1 siblings of request R "<index>_R".
    return req_id == request_id or (req_id.endswith(f"_{request_id}") and req_id.split("_", 1)[0].isdigit())


@contextlib.contextmanager
def inject_fault(
    engine: Any,
    site: Site,
    *,
    request_id: str | None = None,
    after: int = 0,
    times: int | None = 1,
    error: BaseException | None = None,
) -> Iterator[Fault]:
    """Makes ``site`` of ``engine`` raise while the block runs (see ``Fault`` for the knobs).

    Args:
        engine: an ``Engine`` or an ``AsyncEngine``.

    Yields:
        The ``Fault``, to read ``num_fired`` / ``num_calls`` afterwards.
    """
    from engine import AsyncEngine

    fault = Fault(site, request_id, after, times, error)
    owner, name = _owner(engine.engine if isinstance(engine, AsyncEngine) else engine, site)
    had_own = name in vars(owner)
    real = getattr(owner, name)
    # NOTE: one attribute store each way; the driver thread looks the attribute up on every
    # call, so the swap lands between two calls without stopping it (the GIL orders them).
    setattr(owner, name, _wrap(real, fault, site))
    try:
        yield fault
    finally:
        if had_own:
            setattr(owner, name, real)
        else:
            delattr(owner, name)


def _owner(engine: Any, site: Site) -> tuple[Any, str]:
    if site == "execute_model":
        return engine.runner, "execute_model"
    if site == "sampler":
        return engine, "sampler"
    return engine.scheduler, "schedule"


class _FaultySampler:
    """The engine's sampler, raising first when the fault is due; everything else passes through."""

    def __init__(self, real: Any, fault: Fault) -> None:
        self._real = real
        self._fault = fault

    def __call__(self, logits: Any, requests: Any, token_mask: Any = None) -> Any:
        self._fault.maybe_fire([r.req_id for r in requests])
        return self._real(logits, requests, token_mask)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _wrap(real: Callable[..., Any], fault: Fault, site: Site) -> Callable[..., Any]:
    if site == "execute_model":

        def execute_model(scheduler_output: Any) -> Any:
            fault.maybe_fire([s.req_id for s in scheduler_output.scheduled])
            return real(scheduler_output)

        return execute_model
    if site == "sampler":
        return _FaultySampler(real, fault)
    scheduler = real.__self__

    def schedule() -> Any:
        fault.maybe_fire(list(scheduler.requests))
        return real()

    return schedule
