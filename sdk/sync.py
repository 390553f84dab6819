"""Client: the sync face of AsyncClient, run on the event-loop thread of the client's runtime."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

from sdk.client import AsyncClient, MessagesLike, PromptLike
from sdk.closing import Closing
from sdk.prefix import PrefixHandle
from sdk.retrieval import EmbedInputLike, EmbeddingResult, RerankResult, ScoreResult
from sdk.settings import ClientSettings
from sdk.types import ChatResult, CompletionResult, Delta

_END = object()


class Client(Closing):
    """The sync SDK client: ``AsyncClient``'s methods, blocking; safe to call from any thread.

    Requests run on the loop thread of the client's runtime (``runtime``, or its own, which
    ``close()`` closes); ``stream()`` reads the same delta channel as the async client
    through a thread-safe queue. Arguments as ``AsyncClient`` (``model``, ``settings=`` or keywords).

    Example:
        client = Client()  # or Client(base_url="http://gpu-box:8000/v1", api_key=KEY)
        with client.prefix(SYSTEM) as system:
            print(client.chat([*system.messages, ("user", "Hi")]).text)
    """

    def __init__(self, model: str | None = None, *, settings: ClientSettings | None = None, **keywords: Any) -> None:
        self.aclient = AsyncClient(model, settings=settings, **keywords)
        self.settings = self.aclient.settings
        """``AsyncClient.settings``: what the client was given."""
        self.runtime = self.aclient.runtime
        """``AsyncClient.runtime``: the engine's owner, whose loop thread runs this client's calls."""

    @property
    def model_name(self) -> str:
        self.start()
        return self.aclient.model_name

    @property
    def max_model_len(self) -> int:
        self.start()
        return self.aclient.max_model_len

    def start(self) -> None:
        """``AsyncClient.start``, blocking: load the engine (or connect) before the first request."""
        self.runtime.run_sync(self.aclient.start())

    def stats(self) -> dict[str, Any]:
        """``AsyncClient.stats()``; starts the engine if needed."""
        self.start()
        return self.aclient.stats()

    def chat(self, messages: MessagesLike, **options: Any) -> ChatResult:
        """``AsyncClient.chat``, blocking."""
        return self.runtime.run_sync(self.aclient.chat(messages, **options))

    def complete(self, prompt: PromptLike, **options: Any) -> CompletionResult:
        """``AsyncClient.complete``, blocking."""
        return self.runtime.run_sync(self.aclient.complete(prompt, **options))

    def retrieve(self, request_id: str) -> CompletionResult:
        """``AsyncClient.retrieve``, blocking."""
        return self.runtime.run_sync(self.aclient.retrieve(request_id))

    def batch(self, requests: Iterable[MessagesLike], *, return_exceptions: bool = False, **options: Any) -> list[Any]:
        """``AsyncClient.batch``, blocking; the requests run concurrently."""
        return self.runtime.run_sync(self.aclient.batch(list(requests), return_exceptions=return_exceptions, **options))

    def embed(self, input: EmbedInputLike, **options: Any) -> EmbeddingResult:
        """``AsyncClient.embed``, blocking."""
        return self.runtime.run_sync(self.aclient.embed(input, **options))

    def score(self, query: str, documents: str | Sequence[str], **options: Any) -> ScoreResult:
        """``AsyncClient.score``, blocking."""
        return self.runtime.run_sync(self.aclient.score(query, documents, **options))

    def rerank(self, query: str, documents: Sequence[str], **options: Any) -> RerankResult:
        """``AsyncClient.rerank``, blocking (``top_n``, ``return_documents`` and pooling options)."""
        return self.runtime.run_sync(self.aclient.rerank(query, documents, **options))

    def prefix(self, prefix: Any, *, cache_salt: str | None = None) -> PrefixHandle:
        """``AsyncClient.prefix``, blocking; close the handle with ``close()`` or ``with``."""
        return self.runtime.run_sync(self.aclient.prefix(prefix, cache_salt=cache_salt))

    def stream(self, messages: MessagesLike | None = None, *, prompt: PromptLike | None = None, **options: Any) -> Iterator[Delta]:
        """``AsyncClient.stream``, as a blocking iterator; closing it early aborts the request."""
        return self._iterate(self.aclient.stream(messages, prompt=prompt, **options))

    def respond(self, input: Any = None, *, stream: bool = False, **fields: Any) -> Any:
        """``AsyncClient.respond``, blocking: the ``Response``, or with ``stream`` a blocking iterator of its events
        (errors before the first event raise from this call; closing it early aborts the reply)."""
        if not stream:
            return self.runtime.run_sync(self.aclient.respond(input, **fields))
        return self._iterate(self.runtime.run_sync(self.aclient.respond(input, stream=True, **fields)))

    def _iterate(self, agen: AsyncIterator[Any]) -> Iterator[Any]:
        """The items of ``agen``, read on the runtime's loop through a thread-safe queue; leaving early closes it."""
        channel: queue.SimpleQueue[Any] = queue.SimpleQueue()
        done = threading.Event()

        async def pump() -> None:
            try:
                async for item in agen:
                    channel.put(item)
                channel.put(_END)
            except BaseException as exc:
                channel.put(exc)
            finally:
                await agen.aclose()  # type: ignore[attr-defined]
                done.set()

        return self._drain(self.runtime.submit(pump()), channel, done)

    @staticmethod
    def _drain(future: concurrent.futures.Future[None], channel: queue.SimpleQueue[Any], done: threading.Event) -> Iterator[Any]:
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
        """``AsyncClient.aclose``: unpin open prefixes, close connections, close the client's own runtime. Idempotent."""
        if not self.runtime.closed:
            self.runtime.run_sync(self.aclient.aclose())
