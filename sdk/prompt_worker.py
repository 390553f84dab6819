"""PromptWorker: chat-template rendering and tokenization on worker threads, tenants taken in turn.

Rendering a conversation costs about a millisecond and tokenizing a long prompt up to
seconds; on the event loop either stalls every other request of the process. The in-process
transport runs them here instead. Jobs queue per tenant and the threads take the tenants
round-robin, so one tenant's burst of 1,000 prompts does not queue another tenant's one
prompt behind it. Callers bound a job before submitting it (``sdk.chat_template.max_prompt_chars``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[concurrent.futures.Future, Callable[..., Any], tuple[Any, ...]]


class PromptWorker:
    """A few daemon threads that run prompt jobs, one tenant's job after another's.

    Args:
        num_threads: worker threads (started on the first job).
    """

    def __init__(self, num_threads: int = 2) -> None:
        self._num_threads = num_threads
        self._threads: list[threading.Thread] = []
        self._cond = threading.Condition()
        self._queues: dict[str | None, deque[_Job]] = {}
        self._turns: deque[str | None] = deque()  # tenants with queued jobs, in turn order

    async def run(self, tenant: str | None, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread, queued behind ``tenant``'s earlier jobs only.

        A cancelled caller's job is dropped if it has not started.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if len(self._threads) < self._num_threads:
                thread = threading.Thread(target=self._work, name="paged-prompt-worker", daemon=True)
                self._threads.append(thread)
                thread.start()
            queue = self._queues.get(tenant)
            if queue is None:
                queue = self._queues[tenant] = deque()
                self._turns.append(tenant)
            queue.append((future, fn, args))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    def _next(self) -> _Job:
        with self._cond:
            while not self._turns:
                self._cond.wait()
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            job = queue.popleft()
            if queue:
                self._turns.append(tenant)
            else:
                del self._queues[tenant]
            return job

    def _work(self) -> None:
        while True:
            future, fn, args = self._next()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                future.set_exception(exc)


PROMPT_WORKER = PromptWorker()  # shared by the in-process transports of this process
