"""Client: the sync face of AsyncClient, run on one private event-loop thread shared by the process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from sdk.client import AsyncClient, MessagesLike, PrefixHandle, PromptLike
from sdk.hooks import Hook
from sdk.transport import Transport
from sdk.types import ChatResult, CompletionResult, Delta

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_lock = threading.Lock()


def _sdk_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            _thread = threading.Thread(target=_loop.run_forever, name="paged-sdk-loop", daemon=True)
            _thread.start()
        return _loop


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on the SDK loop thread without waiting."""
    return asyncio.run_coroutine_threadsafe(coro, _sdk_loop())


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the SDK loop thread and wait for it (never nests an event loop).

    Raises:
        RuntimeError: called from the SDK loop thread itself (it would deadlock).
    """
    loop = _sdk_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("a sync SDK call from inside the SDK's own loop thread; use AsyncClient")
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result()
    except BaseException:
        future.cancel()  # KeyboardInterrupt and friends: abort the request, do not leave it running
        raise


_END = object()


class Client:
    """The sync SDK client: ``AsyncClient``'s methods, blocking; safe to call from any thread.

    Requests run on a private event-loop thread; ``stream()`` reads the same delta channel
    as the async client through a thread-safe queue. Arguments as ``AsyncClient``.

    Example:
        client = Client()  # or Client(base_url="http://gpu-box:8000/v1", api_key=KEY)
        with client.prefix(SYSTEM) as system:
            print(client.chat([*system.messages, ("user", "Hi")]).text)
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        hooks: Iterable[Hook] = (),
        tenant: str | None = None,
        transport: Transport | None = None,
        route: str = "client",
        max_retries: int = 0,
        **engine_config: Any,
    ) -> None:
        self.aclient = AsyncClient(
            model, base_url=base_url, api_key=api_key, hooks=list(hooks), tenant=tenant, transport=transport,
            route=route, max_retries=max_retries, **engine_config,
        )  # fmt: skip

    @property
    def model_name(self) -> str:
        run_sync(self.aclient.start())
        return self.aclient.model_name

    @property
    def max_model_len(self) -> int:
        run_sync(self.aclient.start())
        return self.aclient.max_model_len

    def stats(self) -> dict[str, Any]:
        """``AsyncClient.stats()``; starts the engine if needed."""
        run_sync(self.aclient.start())
        return self.aclient.stats()

    def chat(self, messages: MessagesLike, **options: Any) -> ChatResult:
        """``AsyncClient.chat``, blocking."""
        return run_sync(self.aclient.chat(messages, **options))

    def complete(self, prompt: PromptLike, **options: Any) -> CompletionResult:
        """``AsyncClient.complete``, blocking."""
        return run_sync(self.aclient.complete(prompt, **options))

    def batch(self, requests: Iterable[MessagesLike], *, return_exceptions: bool = False, **options: Any) -> list[Any]:
        """``AsyncClient.batch``, blocking; the requests run concurrently."""
        return run_sync(self.aclient.batch(list(requests), return_exceptions=return_exceptions, **options))

    def prefix(self, prefix: Any, *, cache_salt: str | None = None) -> PrefixHandle:
        """``AsyncClient.prefix``, blocking; close the handle with ``close()`` or ``with``."""
        return run_sync(self.aclient.prefix(prefix, cache_salt=cache_salt))

    def stream(self, messages: MessagesLike | None = None, *, prompt: PromptLike | None = None, **options: Any) -> Iterator[Delta]:
        """``AsyncClient.stream``, as a blocking iterator; closing it early aborts the request."""
        agen = self.aclient.stream(messages, prompt=prompt, **options)
        channel: queue.SimpleQueue[Any] = queue.SimpleQueue()
        done = threading.Event()

        async def pump() -> None:
            try:
                async for delta in agen:
                    channel.put(delta)
                channel.put(_END)
            except BaseException as exc:
                channel.put(exc)
            finally:
                await agen.aclose()  # type: ignore[attr-defined]
                done.set()

        return self._drain(submit(pump()), channel, done)

    @staticmethod
    def _drain(future: concurrent.futures.Future[None], channel: queue.SimpleQueue[Any], done: threading.Event) -> Iterator[Delta]:
        try:
            while (item := channel.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not done.is_set():
                future.cancel()  # the consumer left early: cancel the pump, which aborts the request
                done.wait()

    def close(self) -> None:
        """``AsyncClient.aclose``: unpin open prefixes, close connections (the shared engine stays up)."""
        run_sync(self.aclient.aclose())

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
