"""Runtime: the explicit owner of an in-process engine and of the event-loop thread sync callers use.

A client without ``runtime=`` makes its own; give several clients and adapters one
``Runtime`` to share one engine (one model load, one prefix cache):

    with Runtime(num_blocks=512) as runtime:
        support, search = Client(runtime=runtime), Client(runtime=runtime)

A RAG process holds its chat model and its embedder (and a reranker) in one runtime; its clients
chat on the first and embed, rerank and score on the others:

    with Runtime(CHAT, embedding_model=MINILM, rerank_model=BGE_RERANKER) as runtime:
        client = Client(runtime=runtime)
        client.embed(chunks), client.rerank(question, hits), client.chat(prompt)

Several chat models (a list of ``model``) load an engine each; a client picks one by its name (None: the first):

    with Runtime([LLAMA, QWEN]) as runtime:
        llama, qwen = Client(runtime=runtime), Client(runtime=runtime, model="Qwen2-0.5B-Instruct")

The engines of a process step in turn (``engine.driver.STEP_LOCK``): each step has all of torch's
threads and no two steps contend for the cores. While the chat model has requests, a pooling engine beside
it runs at most ``pooling_time_fraction`` of a chat step between two of them (a batch a layer at a time), so
an embedding burst stretches a chat decode's inter-token latency by that fraction at most.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import weakref
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sdk.closing import AsyncClosing, Closing

if TYPE_CHECKING:
    from engine import AsyncEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _State:
    """What the finalizer releases; it holds no reference to the ``Runtime``."""

    engine: AsyncEngine | None
    owns_engine: bool
    closed: bool = False
    # the pooling engines beside the chat engine, by the task they serve ("embed", "score"); always owned
    pooling: dict[str, AsyncEngine] = field(default_factory=dict)
    chat: list[AsyncEngine] = field(default_factory=list)  # the chat engines beside the first, in order; always owned
    steps_shared: bool = False  # the pooling engines yield to the chat engines (set once, after they load)
    loop: asyncio.AbstractEventLoop | None = None
    thread: threading.Thread | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)


class Runtime(Closing, AsyncClosing):
    """Owns at most one ``engine.AsyncEngine`` and a private event-loop thread; closeable.

    The engine is the one given, or is loaded from ``model`` and ``engine_config`` on the
    first ``start()``. The loop thread starts on the first ``run_sync()`` / ``submit()``.
    ``close()`` (also on garbage collection and at interpreter exit) shuts down an engine
    the runtime loaded, never one it was given (``AsyncEngine.aclose``: it saves its KV cache
    where ``kv_cache_dir`` is set), and stops the loop thread. An engine whose
    driver dies restarts itself (``engine.supervisor``): the runtime keeps serving the same
    ``AsyncEngine``, whose ``health()`` says where it stands.

    With several chat models (``model`` a list) it loads an engine for each: the first is ``engine``, and
    ``chat_engine(name)`` is the one of that model name (a client's ``model`` with ``runtime=``); they
    step in turn as a pooling engine does.

    With ``embedding_model`` (and ``rerank_model``) it loads a pooling engine beside the chat model:
    clients embed on the embedding model and rerank / score on the reranker (else on the embedding
    model, by cosine), and chat on ``model``. Every engine of the process steps in turn, and while the chat
    model has requests a pooling engine runs at most ``pooling_time_fraction`` of a chat step between two.

    Args:
        model: HF directory or ``.gguf`` path; None = the bundled SmolLM2-135M-Instruct; a list: several
            chat models, each loaded with ``engine_config``.
        engine: a running engine to serve instead of loading one (not shut down by ``close()``).
        embedding_model: an embedding model's HF directory (``embed``; ``rerank`` / ``score`` without a reranker).
        rerank_model: a cross-encoder's HF directory (``rerank`` / ``score``).
        **engine_config: ``engine.EngineConfig`` fields for the engine it loads; its ``dtype`` and
            ``device`` also for the pooling engines.

    Raises:
        ValueError: ``engine`` together with ``model``, a pooling model or engine_config.
    """

    def __init__(
        self, model: str | Sequence[str] | None = None, *, engine: AsyncEngine | None = None,
        embedding_model: str | None = None, rerank_model: str | None = None, **engine_config: Any,
    ) -> None:  # fmt: skip
        models = [model] if model is None or isinstance(model, (str, os.PathLike)) else [str(m) for m in model]
        if not models:
            raise ValueError("model: an empty list; give at least one model (or None for the bundled one)")
        model, self._chat_models = models[0], models[1:]
        pooling = {task: str(path) for task, path in (("embed", embedding_model), ("score", rerank_model)) if path is not None}
        if engine is not None and (model is not None or engine_config or pooling):
            given = (["model"] if model is not None else []) + sorted(engine_config)
            given += [name for name, path in (("embedding_model", embedding_model), ("rerank_model", rerank_model)) if path]
            raise ValueError(f"engine and {', '.join(given)} both given: the engine is already configured")
        self._model = None if model is None else str(model)
        self._engine_config = engine_config
        self._pooling_models = pooling
        self._state = _State(engine=engine, owns_engine=engine is None)
        self._finalizer = weakref.finalize(self, _release, self._state)

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def engine(self) -> AsyncEngine:
        """The engine (after ``start()``).

        Raises:
            RuntimeError: the runtime is closed, or not started.
        """
        state = self._state
        self._check_open()
        if state.engine is None:
            raise RuntimeError("runtime not started: await start() first")
        return state.engine

    def chat_engine(self, model: str | None = None) -> AsyncEngine:
        """The chat engine of the model named ``model`` (after ``start()``): None = the first, ``engine``.

        Raises:
            NotFoundError: no chat model of the runtime has that name (``param="model"``; it names them).
            RuntimeError: as ``engine``.
        """
        engine = self.engine
        if model is None:
            return engine
        engines = [engine, *self._state.chat]
        found = next((e for e in engines if e.model_name == model), None)
        if found is None:
            from sdk.errors import NotFoundError

            names = ", ".join(repr(e.model_name) for e in engines)
            message = f"model: {model!r} is not a model of this runtime; its chat models: {names}"
            raise NotFoundError(message, param="model")
        return found

    def pooling_engine(self, task: str) -> AsyncEngine:
        """The engine ``embed`` (``task="embed"``) or ``rerank`` / ``score`` (``"score"``) runs on (after ``start()``):
        the embedding model's or the reranker's, when given, else the main engine (whose errors then say what
        it cannot do)."""
        engine = self.engine
        pooling = self._state.pooling
        if task == "score":
            return pooling.get("score") or pooling.get("embed") or engine
        return pooling.get(task) or engine

    async def start(self) -> None:
        """Load the engines that are not loaded yet (off the event loop); idempotent."""
        self._check_open()
        state = self._state
        loaded = len(state.pooling) == len(self._pooling_models) and len(state.chat) == len(self._chat_models)
        if state.engine is None or not loaded:
            # NOTE: loading weights blocks for seconds; it runs off the event loop. The worker gets the state,
            # not a bound method: a pool thread may hold its callable after start() returns, and a runtime
            # it held would outlive its last reference and keep its engine running.
            await asyncio.to_thread(
                _load, state, self._model, self._engine_config, self._pooling_models, self._chat_models
            )
        if state.pooling and not state.steps_shared:
            for engine in state.pooling.values():
                await engine.share_steps()
            state.steps_shared = True

    def run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the runtime's loop thread and wait for it (never nests an event loop).

        Raises:
            RuntimeError: the runtime is closed, or this is its own loop thread (it would deadlock).
        """
        if threading.current_thread() is self._state.thread:
            coro.close()
            raise RuntimeError("a sync SDK call from inside the runtime's own loop thread; use AsyncClient")
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # KeyboardInterrupt and friends: abort the request, do not leave it running
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the runtime's loop thread without waiting."""
        try:
            loop = self._loop()
        except RuntimeError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def close(self) -> None:
        """Shut down the engine the runtime loaded and stop its loop thread; idempotent."""
        self._finalizer()

    async def aclose(self) -> None:
        """``close()`` from async code: the engine shuts down without blocking the event loop."""
        state = self._state
        with state.lock:
            engines = _owned(state) if not state.closed else []
            state.owns_engine = False  # NOTE: shut down here; the finalizer only stops the loop
            state.pooling = {}
            state.chat = []
            state.closed = True
        for engine in engines:
            await engine.shutdown()
        self._finalizer()

    def __repr__(self) -> str:
        state = self._state
        status = "closed" if state.closed else "started" if state.engine is not None else "not started"
        return f"Runtime(model={self._model!r}, {status}, owns_engine={state.owns_engine})"

    def _check_open(self) -> None:
        if self._state.closed:
            raise RuntimeError("the runtime is closed")

    def _loop(self) -> asyncio.AbstractEventLoop:
        state = self._state
        with state.lock:
            self._check_open()
            if state.loop is None:
                state.loop = asyncio.new_event_loop()
                state.thread = threading.Thread(target=_serve, args=(state.loop,), name="paged-sdk-loop", daemon=True)
                state.thread.start()
            return state.loop


def _load(
    state: _State, model: str | None, engine_config: dict[str, Any], pooling_models: dict[str, str],
    chat_models: Sequence[str] = (),
) -> None:  # fmt: skip
    """Load the engines (the chat ones, then the pooling ones) into ``state`` unless loaded or the runtime closed."""
    with state.lock:
        if state.closed:
            raise RuntimeError("the runtime is closed")
        from engine import AsyncEngine

        if state.engine is None:
            state.engine = AsyncEngine(model, **engine_config)
        for path in chat_models[len(state.chat) :]:
            state.chat.append(AsyncEngine(path, **engine_config))
        shared = {k: v for k, v in engine_config.items() if k in ("dtype", "device")}
        for task, path in pooling_models.items():
            if task not in state.pooling:
                state.pooling[task] = AsyncEngine(path, **shared)


def _owned(state: _State) -> list[AsyncEngine]:
    """The engines the runtime shuts down: the pooling engines, and the main one unless it was given."""
    main = [state.engine] if state.owns_engine and state.engine is not None else []
    return [*state.pooling.values(), *state.chat, *main]


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The loop thread: run until stopped, then cancel what is left (its waiters see CancelledError)."""
    try:
        loop.run_forever()
    finally:
        pending = asyncio.all_tasks(loop)
        if pending:
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


def _release(state: _State) -> None:
    """Shut down the owned engine and stop the loop thread: ``close()``, garbage collection, exit."""
    with state.lock:
        engines = _owned(state)
        state.owns_engine = False
        state.pooling = {}
        state.chat = []
        state.closed = True
        loop, thread = state.loop, state.thread
    for engine in engines:
        try:
            _run_to_end(engine.shutdown())
        except Exception:
            logger.exception("engine shutdown failed")
    if loop is not None and thread is not None:
        loop.call_soon_threadsafe(loop.stop)
        if threading.current_thread() is not thread:
            thread.join()


def _run_to_end(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` on a loop of its own, whether or not one is running in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        with asyncio.Runner() as runner:
            # NOTE: at interpreter exit thread pools refuse work, so blocking calls run inline.
            runner.get_loop().set_default_executor(_InlineExecutor())
            runner.run(coro)
        return
    # NOTE: collected inside a running event loop: it cannot nest, so a helper thread runs it.
    helper = threading.Thread(target=_run_to_end, args=(coro,), name="paged-engine-shutdown")
    helper.start()
    helper.join()


class _InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future
