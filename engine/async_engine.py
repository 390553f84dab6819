"""AsyncEngine: an Engine stepped by a driver thread of its own, with asyncio streams per request.

Callers never touch the Engine: they post commands (Add, Abort, Pin, ...) into a
thread-safe inbox; the driver thread drains it between steps, steps while there is work
and sleeps on the inbox when there is none. Each request's outputs go to an asyncio
queue on the caller's loop through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineError, EngineOverloaded, ParameterError
from engine.llm_engine import Engine, Prompt, check_params, tokenize
from engine.outputs import PinnedPrefix, RequestOutput
from engine.request_options import RequestOptions, TenantOptions
from engine.sampling_params import SamplingParams
from engine.structured_output.compiler import MAX_COMPILE_SECONDS, too_slow
from engine.structured_output.params import StructuredOutput

logger = logging.getLogger(__name__)

_LIVENESS_POLL_S = 0.5  # a waiter re-checks the driver at least this often


class _Channel:
    """One request's stream: an asyncio queue on its consumer's loop, fed by the driver thread."""

    __slots__ = ("loop", "queue", "num_tokens", "reserved", "finished")

    def __init__(self, loop: asyncio.AbstractEventLoop, num_tokens: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.num_tokens = num_tokens
        self.reserved = True  # holds an admission slot until it leaves the queue
        self.finished = False

    def send(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    tenant: str | None
    weight: float
    channel: _Channel
    grammar: Any = None  # params.structured_output, compiled


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    """Runs ``fn(engine)`` on the driver thread and resolves ``future`` with its result."""

    fn: Callable[[Engine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)


@dataclass(slots=True)
class _Pin:
    prompt_token_ids: list[int]
    cache_salt: str | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)


class _Stop:
    pass


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None,
             error: BaseException | None = None) -> None:
    def settle() -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


class AsyncEngine:
    """The engine behind asyncio: streaming generation, abort, prefix pinning, stats.

    Args:
        model: A Hugging Face model directory or a ``.gguf`` file; None = the bundled SmolLM2.
        config: All settings at once; keyword arguments (``EngineConfig`` fields) override it.
        **overrides: ``EngineConfig`` fields.
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **overrides: Any) -> None:
        self._engine = Engine(model, config=config, **overrides)
        self.config = self._engine.config
        # NOTE: callers' threads get a tokenizer of their own: the driver decodes with the
        # engine's while callers encode, and a Rust tokenizer must not be borrowed by both.
        self._tokenizer = copy.deepcopy(self._engine.tokenizer)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # admission counters and the set of live request ids
        self._queued_requests = 0
        self._queued_tokens = 0
        self._live_ids: set[str] = set()
        self._num_rejected = 0  # requests refused here, before reaching the driver
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        self._stats: dict[str, Any] = self._engine.stats()
        self._dead: EngineError | None = None
        self._pin_waiters: dict[str, _Pin] = {}  # pins still computing; driver thread only
        self._stopping = False
        self._thread = threading.Thread(target=self._drive, name="paged-engine-driver", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------- properties

    @property
    def engine(self) -> Engine:
        """The ``Engine`` the driver thread steps.

        Only the driver thread calls its methods: read or change it through ``call()``. Its
        ``runner``, ``sampler`` and ``scheduler`` attributes are looked up afresh on every
        step, so a test may swap them from another thread to inject a fault.
        """
        return self._engine

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer, for the caller's thread(s)."""
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        """The figures of ``Engine.stats()``, as published by the driver after its latest step.

        ``requests_rejected`` also counts the requests ``generate`` refused before they reached
        the engine (bad options or prompt, admission limits full).
        """
        stats = self._stats
        return {**stats, "requests_rejected": stats["requests_rejected"] + self._num_rejected}

    # ---------------------------------------------------------------------------- requests

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's cumulative outputs; the last has ``finished=True``.

        Closing or cancelling the iterator aborts the request and frees its blocks.
        ``tenant`` and ``weight`` are the fair share's (``Engine.add_request``).

        Raises:
            RequestRejected: From the first ``__anext__``: empty prompt, a token id outside
                the vocabulary, longer than max_model_len or than the KV cache holds.
            EngineOverloaded: From the first ``__anext__``: admission limits are full.
            ParameterError: Bad ``params``, ``request_id``, ``priority``, ``cache_salt``,
                ``tenant`` or ``weight``, a request id already in use, or a structured-output constraint that does not
                compile (compiled on the compiler's threads, never on the step loop).
            EngineError: The engine failed this request, or is dead / shut down.
        """
        self._check_alive()
        try:
            params = check_params(params)
            RequestOptions(request_id, priority, cache_salt)
            TenantOptions(tenant, weight)
            prompt_token_ids = tokenize(self._tokenizer, prompt)
            self._engine.validate_prompt(prompt_token_ids)  # reads immutable settings only
            grammar = None
            if params.structured_output is not None:
                grammar = await self._compile(params.structured_output)
            if request_id is None:
                request_id = f"{self._id_prefix}-{next(self._ids)}"
            channel = _Channel(asyncio.get_running_loop(), len(prompt_token_ids))
            self._admit(request_id, channel)
        except (ParameterError, EngineOverloaded):
            with self._lock:
                self._num_rejected += 1
            raise
        try:
            self._inbox.put(_Add(request_id, prompt_token_ids, params, priority, cache_salt, tenant, weight, channel, grammar))
            self._check_alive()  # NOTE: a driver that died before draining this Add never answers it
            while True:
                item = await self._next(channel)
                if isinstance(item, BaseException):
                    channel.finished = True
                    raise item
                if item.finished:
                    channel.finished = True
                yield item
                if channel.finished:
                    return
        finally:
            if not channel.finished and self._dead is None:
                self._inbox.put(_Abort(request_id))
            self._release(channel)
            with self._lock:
                self._live_ids.discard(request_id)

    async def abort(self, request_id: str) -> None:
        """Aborts a request (its stream ends with finish_reason "abort"); unknown ids are a no-op."""
        if self._dead is None:
            self._inbox.put(_Abort(request_id))

    async def pin_prefix(self, prompt: Prompt, cache_salt: str | None = None) -> PinnedPrefix:
        """Computes the prompt's KV once and keeps its blocks referenced until ``unpin_prefix``.

        Raises:
            RequestRejected: The prompt can never be served.
            EngineError: The engine failed the pin, or is dead.
        """
        self._check_alive()
        prompt_token_ids = tokenize(self._tokenizer, prompt)
        self._engine.validate_prompt(prompt_token_ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_Pin(prompt_token_ids, cache_salt, loop, future))
        return await self._wait(future)

    async def unpin_prefix(self, pin_id: str) -> None:
        """Releases a pinned prefix; its blocks stay cached until evicted. Unknown ids are a no-op."""
        if self._dead is None:
            await self.call(lambda engine: self._unpin(engine, pin_id))

    def _unpin(self, engine: Engine, pin_id: str) -> None:
        engine.unpin_prefix(pin_id)
        waiter = self._pin_waiters.pop(pin_id, None)
        if waiter is not None:  # unpinned before it finished computing
            _resolve(waiter.loop, waiter.future, error=EngineError(f"prefix {pin_id} was unpinned while pinning"))

    async def shutdown(self) -> None:
        """Aborts every request and stops the driver thread; idempotent."""
        if not self._stopping:
            self._stopping = True
            self._inbox.put(_Stop())
        await asyncio.to_thread(self._thread.join)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Runs ``fn(engine)`` on the driver thread between two steps and returns its result.

        The one way to read or change the ``Engine`` behind this object (inspection in tests,
        maintenance): nothing else touches it while ``fn`` runs.

        Raises:
            EngineError: The engine is dead or shut down; whatever ``fn`` raised.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_Call(fn, loop, future))
        return await self._wait(future)

    # ---------------------------------------------------------------------------- caller side

    async def _compile(self, constraint: StructuredOutput) -> Any:
        """A structured-output constraint compiled on the compiler's threads: never on the step loop."""
        future = asyncio.wrap_future(self._engine.grammars.submit(constraint))
        try:
            return await asyncio.wait_for(future, MAX_COMPILE_SECONDS)
        except TimeoutError:
            raise too_slow(constraint) from None

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._stopping:
            raise EngineError("the engine is shut down")

    def _admit(self, request_id: str, channel: _Channel) -> None:
        limits = self.config
        with self._lock:
            if request_id in self._live_ids:
                raise ParameterError("request_id", f"request id {request_id!r} is already in use")
            if self._queued_requests + 1 > limits.max_queued_requests:
                raise EngineOverloaded(f"{self._queued_requests} requests are queued (max_queued_requests)")
            if self._queued_tokens + channel.num_tokens > limits.max_queued_tokens:
                raise EngineOverloaded(f"{self._queued_tokens} prompt tokens are queued (max_queued_tokens)")
            self._queued_requests += 1
            self._queued_tokens += channel.num_tokens
            self._live_ids.add(request_id)

    def _release(self, channel: _Channel) -> None:
        with self._lock:
            if channel.reserved:
                channel.reserved = False
                self._queued_requests -= 1
                self._queued_tokens -= channel.num_tokens

    # NOTE: both waits poll with asyncio.wait, not wait_for: on Python 3.11 wait_for returns
    # the result and drops the caller's cancellation when both land in one loop iteration, so
    # a cancelled consumer would go on reading (and its request would never be aborted).

    async def _next(self, channel: _Channel) -> RequestOutput | BaseException:
        while True:
            if not channel.queue.empty():
                return channel.queue.get_nowait()
            getter = asyncio.ensure_future(channel.queue.get())
            try:
                await asyncio.wait((getter,), timeout=_LIVENESS_POLL_S)
            finally:
                getter.cancel()
            if getter.done() and not getter.cancelled():
                return getter.result()
            if self._dead is not None and channel.queue.empty():
                return self._dead

    async def _wait(self, future: asyncio.Future) -> Any:
        while not future.done():
            await asyncio.wait((future,), timeout=_LIVENESS_POLL_S)
            if self._dead is not None and not future.done():
                raise self._dead
        return future.result()

    # ---------------------------------------------------------------------------- driver thread

    def _drive(self) -> None:
        channels: dict[str, _Channel] = {}
        pins = self._pin_waiters
        engine = self._engine
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                commands = [self._inbox.get()] if idle else []
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if isinstance(command, _Stop):
                        for output in engine.abort_request(list(channels)):
                            self._dispatch(channels, output, None)
                        return
                    self._handle(engine, command, channels, pins)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    failures = engine.pop_failures()
                    self._stats = engine.stats()
                    for output in outputs:
                        if output.request_id in pins:
                            pin = pins.pop(output.request_id)
                            error = failures.get(output.request_id)
                            result = PinnedPrefix(output.request_id, len(pin.prompt_token_ids), output.num_cached_tokens)
                            _resolve(pin.loop, pin.future, result, error)
                        else:
                            self._dispatch(channels, output, failures.get(output.request_id))
                else:
                    self._stats = engine.stats()
        except BaseException as exc:
            logger.exception("the engine driver died")
            self._dead = EngineError(f"the engine driver died: {exc!r}")
        finally:
            if self._dead is None:
                self._dead = EngineError("the engine is shut down")
            while True:  # NOTE: commands posted before _dead was set are answered here
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Add):
                    command.channel.send(self._dead)
                elif isinstance(command, (_Pin, _Call)):
                    _resolve(command.loop, command.future, error=self._dead)
            for channel in channels.values():
                channel.send(self._dead)
            for pin in pins.values():
                _resolve(pin.loop, pin.future, error=self._dead)

    def _handle(self, engine: Engine, command: Any, channels: dict[str, _Channel], pins: dict[str, _Pin]) -> None:
        if isinstance(command, _Add):
            try:
                engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                   command.priority, command.cache_salt, tenant=command.tenant,
                                   weight=command.weight, grammar=command.grammar)
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                command.channel.send(exc)
                return
            channels[command.request_id] = command.channel
        elif isinstance(command, _Abort):
            if command.request_id in pins:
                self._unpin(engine, command.request_id)
                return
            for output in engine.abort_request(command.request_id):
                self._dispatch(channels, output, None)
        elif isinstance(command, _Pin):
            try:
                pin_id = engine.pin_prefix(command.prompt_token_ids, command.cache_salt)
            except Exception as exc:  # noqa: BLE001
                _resolve(command.loop, command.future, error=exc)
                return
            pins[pin_id] = command
        elif isinstance(command, _Call):
            try:
                result = command.fn(engine)
            except Exception as exc:  # noqa: BLE001
                _resolve(command.loop, command.future, error=exc)
                return
            _resolve(command.loop, command.future, result)

    def _dispatch(self, channels: dict[str, _Channel], output: RequestOutput, error: EngineError | None) -> None:
        channel = channels.get(output.request_id)
        if channel is None:
            return
        self._release(channel)  # the request left the waiting queue (or finished)
        if output.finished:
            del channels[output.request_id]
        channel.send(error if error is not None else output)
