"""The one quiescence check: after a test, nothing is left running, holding blocks or scheduled.

Quiescent means:

- no request running or waiting, no request state left in the engine (outputs all emitted,
  no pinned prefix, no block table in the KV cache manager);
- every KV block free or evictable with ref count 0, and ``check_integrity()`` holds;
- no stray asyncio task: every task that did not exist when the test started has ended.

``check_engine_quiescent`` checks an ``Engine`` at once; ``assert_quiescent`` waits (up to a
timeout) for any object that leads to one (an ``AsyncEngine``, an SDK client, runtime or
transport, the server's ``Serving``) to become quiescent, reading it on the engine's driver
thread through ``AsyncEngine.call``. Only public reads are used.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["NotQuiescent", "assert_quiescent", "check_engine_quiescent", "find_engines", "running_tasks"]



class NotQuiescent(AssertionError):
    """Something is still running, queued, referenced or scheduled; the message says what."""


def check_engine_quiescent(engine: Any) -> None:
    """Checks a synchronous ``Engine`` is at rest (call it on the thread that owns the engine).

    Raises:
        NotQuiescent: naming the first thing that is not at rest.
    """
    scheduler, kv = engine.scheduler, engine.kv
    problems = []
    if scheduler.running or scheduler.num_waiting:
        problems.append(f"{scheduler.num_running} running / {scheduler.num_waiting} waiting requests")
    if scheduler.requests:
        problems.append(f"scheduler still tracks {sorted(scheduler.requests)[:5]}")
    if unfinished := engine.unfinished_request_ids():
        problems.append(f"engine still holds requests {sorted(unfinished)[:5]}")
    if pins := engine.pinned_prefix_ids():
        problems.append(f"prefixes still pinned: {sorted(pins)[:5]}")
    if kv.req_ids:
        problems.append(f"block tables left for {sorted(kv.req_ids)[:5]}")
    referenced = [b.block_id for b in kv.block_pool.blocks if b.ref_cnt != 0]
    if referenced:
        problems.append(f"{len(referenced)} blocks referenced, e.g. {referenced[:5]}")
    try:
        kv.check_integrity()
    except AssertionError as exc:
        problems.append(f"integrity: {exc}")
    stats = kv.stats()
    if stats.num_used_blocks or stats.num_free_blocks != stats.num_blocks:
        problems.append(f"{stats.num_used_blocks} blocks used, {stats.num_free_blocks} of {stats.num_blocks} free")
    if problems:
        raise NotQuiescent("engine not quiescent: " + "; ".join(problems))


def find_engines(target: Any) -> tuple[Any | None, Any | None]:
    """``(AsyncEngine, None)`` or ``(None, Engine)`` behind an engine, client, runtime, transport or ``Serving``.

    Follows the public attributes that lead to an engine: ``AsyncClient.transport``,
    ``transport.engine``, ``Runtime.engine``, ``Serving.engine``.
    """
    from engine import AsyncEngine, Engine

    obj = target
    for _ in range(8):
        if isinstance(obj, AsyncEngine):
            return obj, None
        if isinstance(obj, Engine):
            return None, obj
        inner = getattr(obj, "transport", None) or getattr(obj, "engine", None)
        if inner is None or inner is obj:
            break
        obj = inner
    raise TypeError(f"no engine found behind {type(target).__name__}")


def running_tasks() -> set[asyncio.Task]:
    """The running loop's unfinished tasks, except the caller's own."""
    current = asyncio.current_task()
    return {t for t in asyncio.all_tasks() if t is not current and not t.done()}


async def assert_quiescent(
    target: Any,
    *,
    tasks_before: set[asyncio.Task] | None = None,
    timeout: float = 2.0,
) -> None:
    """Waits until ``target``'s engine is quiescent and no new asyncio task is left.

    Args:
        target: an ``Engine``, ``AsyncEngine``, ``sdk.AsyncClient``, transport or ``Serving``.
        tasks_before: the tasks that existed when the test started (``running_tasks()``);
            None skips the task check.
        timeout: seconds to wait for in-flight aborts and cleanups to land.

    Raises:
        NotQuiescent: still not at rest after ``timeout``, saying why.
    """
    async_engine, engine = find_engines(target)
    deadline = time.monotonic() + timeout
    while True:
        try:
            await _check_once(async_engine, engine, tasks_before)
            return
        except NotQuiescent:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.01)


async def _check_once(async_engine: Any, engine: Any, tasks_before: set[asyncio.Task] | None) -> None:
    if async_engine is None:
        check_engine_quiescent(engine)  # nobody else touches it
    elif not async_engine.is_running:
        check_engine_quiescent(async_engine.engine)  # its driver is gone
    else:
        # NOTE: the driver thread owns the engine: read it there, between two steps.
        await async_engine.call(check_engine_quiescent)
    if tasks_before is not None:
        stray = running_tasks() - tasks_before
        if stray:
            names = sorted(t.get_name() + ":" + getattr(t.get_coro(), "__qualname__", "?") for t in stray)
            raise NotQuiescent(f"{len(stray)} stray asyncio tasks: {names[:5]}")
