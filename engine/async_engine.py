"""AsyncEngine: an Engine stepped by a driver thread of its own, with asyncio streams per request.

Callers never touch the Engine: they post commands (Add, Abort, Pin, ...) into a
thread-safe inbox; the driver thread drains it between steps, steps while there is work
and sleeps on the inbox when there is none. Each request's deltas of a step go to an
asyncio queue on the caller's loop through ``loop.call_soon_threadsafe``: ``stream()``
yields them, ``generate()`` builds cumulative outputs from them.

The driver thread also supervises: when driving dies (an exception outside a step), every
request of that engine fails with ``EngineRestarting`` and a fresh ``Engine`` is started
under the ``RestartPolicy`` (``engine.supervisor``). Each engine is one generation; a
command tagged with an older generation than the one serving is answered with
``EngineRestarting``, never run on the fresh engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineError, EngineOverloaded, EngineRestarting, ParameterError
from engine.llm_engine import Engine, Prompt, check_params, tokenize
from engine.outputs import Delta, OutputAccumulator, PinnedPrefix, RequestOutput
from engine.request_options import RequestOptions, TenantOptions
from engine.sampling_params import SamplingParams
from engine.structured_output.compiler import MAX_COMPILE_SECONDS, too_slow
from engine.structured_output.params import StructuredOutput
from engine.supervisor import (
    CrashLoop, EngineHealth, RestartPolicy, describe, forget_frames, release_memory, restart_config,
)

logger = logging.getLogger(__name__)

_LIVENESS_POLL_S = 0.5  # a waiter re-checks the driver at least this often
_MIN_RETRY_AFTER_S = 0.1  # the shortest wait EngineRestarting advises


class _Channel:
    """One request's stream: an asyncio queue on its consumer's loop, fed by the driver thread."""

    __slots__ = ("loop", "queue", "num_tokens", "generation", "reserved", "finished")

    def __init__(self, loop: asyncio.AbstractEventLoop, num_tokens: int, generation: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[list[Delta] | BaseException] = asyncio.Queue()  # a step's deltas, or the error
        self.num_tokens = num_tokens
        self.generation = generation  # the engine it was admitted to
        self.reserved = True  # holds an admission slot until it leaves the queue
        self.finished = False

    def send(self, item: list[Delta] | BaseException) -> None:
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
    generation: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)


@dataclass(slots=True)
class _Pin:
    prompt_token_ids: list[int]
    cache_salt: str | None
    generation: int
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


def _public_pin_id(pin_id: str, generation: int) -> str:
    """The id callers get for an engine's pin: a fresh engine numbers its pins from 0 again."""
    return pin_id if generation == 0 else f"{pin_id}.{generation}"


def _engine_pin_id(public_id: str) -> tuple[str, int]:
    """``(the engine's pin id, its generation)`` of an id ``_public_pin_id`` made."""
    pin_id, _, generation = public_id.partition(".")
    return pin_id, int(generation) if generation.isdigit() else 0


class AsyncEngine:
    """The engine behind asyncio: streaming generation, abort, prefix pinning, stats; it heals itself.

    When its driver dies, the requests in flight fail with ``EngineRestarting`` (retryable)
    and a fresh ``Engine`` is loaded from the same configuration under ``restart``; once
    that policy is spent the engine is dead and every call raises ``EngineError``
    (``engine.supervisor``). ``health()`` says which.

    Args:
        model: A Hugging Face model directory or a ``.gguf`` file; None = the bundled SmolLM2.
        config: All settings at once; keyword arguments (``EngineConfig`` fields) override it.
        restart: When to replace a driver that died; None = ``RestartPolicy()``.
        **overrides: ``EngineConfig`` fields.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        restart: RestartPolicy | None = None,
        **overrides: Any,
    ) -> None:
        if restart is not None and not isinstance(restart, RestartPolicy):
            raise ParameterError("restart", f"restart must be a RestartPolicy; got {type(restart).__name__}")
        started = time.monotonic()
        engine = Engine(model, config=config, **overrides)
        self._load_s = time.monotonic() - started  # how long the latest engine took to start
        self.config = engine.config
        self._restart_config = restart_config(engine.config, engine.runner.num_blocks)
        self._model_name = engine.model_name
        self._max_model_len = engine.max_model_len
        # NOTE: callers' threads get a tokenizer of their own: the driver decodes with the
        # engine's while callers encode, and a Rust tokenizer must not be borrowed by both.
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self._engine: Engine | None = engine  # None while a fresh one starts, and once dead
        self._generation = 0  # which engine serves: 0 for the first, +1 per fresh one
        self._crashes = CrashLoop(restart or RestartPolicy())
        self._restarting = False
        self._ready_by = 0.0  # monotonic time the engine being started should serve by
        self._restarts = 0
        self._last_error: str | None = None
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # admission counters and the set of live request ids
        self._queued_requests = 0
        self._queued_tokens = 0
        self._live_ids: set[str] = set()
        self._num_rejected = 0  # requests refused here, before reaching the driver
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        self._stats: dict[str, Any] = {}
        self._publish(engine)
        self._dead: EngineError | None = None
        self._pin_waiters: dict[str, _Pin] = {}  # pins still computing; driver thread only
        self._stopping = False
        self._thread = threading.Thread(target=self._supervise, name="paged-engine-driver", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------- properties

    @property
    def engine(self) -> Engine:
        """The ``Engine`` the driver thread steps now (a restart replaces it).

        Only the driver thread calls its methods: read or change it through ``call()``. Its
        ``runner``, ``sampler`` and ``scheduler`` attributes are looked up afresh on every
        step, so a test may swap them from another thread to inject a fault.

        Raises:
            EngineRestarting: a fresh engine is starting.
            EngineError: the engine is dead.
        """
        engine = self._engine
        if engine is None:
            raise self._dead if self._dead is not None else self._restart_error()
        return engine

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer, for the caller's thread(s)."""
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

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

    def stats(self) -> dict[str, Any]:
        """The figures of ``Engine.stats()`` as published after the latest step, and ``engine_restarts``.

        A fresh engine's figures start from zero; while it starts, the dead one's last figures stay.
        ``requests_rejected`` also counts the requests ``generate`` refused before they reached
        the engine (bad options or prompt, admission limits full).
        """
        stats = self._stats
        return {**stats, "requests_rejected": stats["requests_rejected"] + self._num_rejected}

    # ---------------------------------------------------------------------------- requests

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0,
        cache_salt: str | None = None, tenant: str | None = None, weight: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Streams one request's cumulative outputs, one per step; the last has ``finished=True``.

        Each output is built from ``stream()``'s deltas and copies the output so far; its
        ``metrics`` is None (the latency breakdown is the last delta's ``usage.latency``).
        Arguments, errors and cancellation as ``stream()``.
        """
        shape = params if isinstance(params, SamplingParams) else SamplingParams()  # NOTE: _steps refuses the rest
        accumulator = OutputAccumulator(shape.n, shape.logprobs is not None)
        steps = self._steps(prompt, params, request_id, priority, cache_salt, tenant, weight)
        async with contextlib.aclosing(steps):
            async for deltas in steps:
                for delta in deltas:
                    accumulator.add(delta)
                yield accumulator.output()

    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0,
        cache_salt: str | None = None, tenant: str | None = None, weight: float = 1.0,
    ) -> AsyncIterator[Delta]:  # fmt: skip
        """Streams one request's deltas: per step, one per completion that progressed; the last has ``usage``.

        Closing or cancelling the iterator aborts the request and frees its blocks.
        ``tenant`` and ``weight`` are the fair share's (``Engine.add_request``).

        Raises:
            RequestRejected: From the first ``__anext__``: empty prompt, a token id outside
                the vocabulary, longer than max_model_len or than the KV cache holds.
            EngineOverloaded: From the first ``__anext__``: admission limits are full.
            ParameterError: Bad ``params``, ``request_id``, ``priority``, ``cache_salt``,
                ``tenant`` or ``weight``, a request id already in use, or a structured-output constraint that does not
                compile (compiled on the compiler's threads, never on the step loop).
            EngineRestarting: The driver died while the request was queued or running, or a
                fresh engine is starting: retry it.
            EngineError: The engine failed this request, or is dead / shut down.
        """
        steps = self._steps(prompt, params, request_id, priority, cache_salt, tenant, weight)
        async with contextlib.aclosing(steps):
            async for deltas in steps:
                for delta in deltas:
                    yield delta

    async def _steps(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, priority: int,
        cache_salt: str | None, tenant: str | None, weight: float,
    ) -> AsyncIterator[list[Delta]]:  # fmt: skip
        """The request's deltas, a step's at a time (see ``stream``)."""
        generation = self._check_alive()
        try:
            params = check_params(params)
            RequestOptions(request_id, priority, cache_salt)
            TenantOptions(tenant, weight)
            prompt_token_ids = tokenize(self._tokenizer, prompt)
            self.engine.validate_prompt(prompt_token_ids)  # reads immutable settings only
            grammar = None
            if params.structured_output is not None:
                grammar = await self._compile(params.structured_output)
            if request_id is None:
                request_id = f"{self._id_prefix}-{next(self._ids)}"
            channel = _Channel(asyncio.get_running_loop(), len(prompt_token_ids), generation)
            self._admit(request_id, channel)
        except (ParameterError, EngineOverloaded):
            with self._lock:
                self._num_rejected += 1
            raise
        try:
            self._inbox.put(_Add(request_id, prompt_token_ids, params, priority, cache_salt, tenant, weight, channel, grammar))
            if (error := self._failure(generation)) is not None:
                raise error  # NOTE: a driver that died before draining this Add may never answer it
            while True:
                item = await self._next(channel)
                if isinstance(item, BaseException):
                    channel.finished = True
                    raise item
                if item[-1].usage is not None:  # the request's last delta
                    channel.finished = True
                yield item
                if channel.finished:
                    return
        finally:
            if not channel.finished and self._failure(generation) is None:
                self._inbox.put(_Abort(request_id))
            self._release(channel)
            with self._lock:
                self._live_ids.discard(request_id)

    async def abort(self, request_id: str) -> None:
        """Aborts a request (its stream ends with finish_reason "abort"); unknown ids are a no-op."""
        if self.is_running:
            self._inbox.put(_Abort(request_id))

    async def pin_prefix(self, prompt: Prompt, cache_salt: str | None = None) -> PinnedPrefix:
        """Computes the prompt's KV once and keeps its blocks referenced until ``unpin_prefix``.

        A pin lives as long as its engine: after a restart the prefix is no longer held (its
        id unpins nothing), and requests compute it again.

        Raises:
            RequestRejected: The prompt can never be served.
            EngineRestarting: The driver died while pinning, or a fresh engine is starting.
            EngineError: The engine failed the pin, or is dead.
        """
        generation = self._check_alive()
        prompt_token_ids = tokenize(self._tokenizer, prompt)
        self.engine.validate_prompt(prompt_token_ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_Pin(prompt_token_ids, cache_salt, generation, loop, future))
        return await self._wait(future, generation)

    async def unpin_prefix(self, pin_id: str) -> None:
        """Releases a pinned prefix; its blocks stay cached until evicted.

        Unknown ids, and pins of an engine that died, are a no-op.
        """
        engine_pin_id, generation = _engine_pin_id(pin_id)
        if self._failure(generation) is None:
            with contextlib.suppress(EngineRestarting):  # NOTE: the pin died with its engine
                await self.call(lambda engine: self._unpin(engine, engine_pin_id))

    def _unpin(self, engine: Engine, pin_id: str) -> None:
        engine.unpin_prefix(pin_id)
        waiter = self._pin_waiters.pop(pin_id, None)
        if waiter is not None:  # unpinned before it finished computing
            _resolve(waiter.loop, waiter.future, error=EngineError(f"prefix {pin_id} was unpinned while pinning"))

    async def shutdown(self) -> None:
        """Aborts every request and stops the driver thread (a restart in progress ends first); idempotent."""
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
            EngineRestarting: The driver died before ``fn`` ran, or a fresh engine is starting.
            EngineError: The engine is dead or shut down; whatever ``fn`` raised.
        """
        generation = self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_Call(fn, generation, loop, future))
        return await self._wait(future, generation)

    # ---------------------------------------------------------------------------- caller side

    async def _compile(self, constraint: StructuredOutput) -> Any:
        """A structured-output constraint compiled on the compiler's threads: never on the step loop."""
        future = asyncio.wrap_future(self.engine.grammars.submit(constraint))
        try:
            return await asyncio.wait_for(future, MAX_COMPILE_SECONDS)
        except TimeoutError:
            raise too_slow(constraint) from None

    def _check_alive(self) -> int:
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
            raise self._restart_error()
        return self._generation

    def _failure(self, generation: int) -> EngineError | None:
        """Why the engine of ``generation`` will not answer any more; None while it serves."""
        if self._dead is not None:
            return self._dead
        if self._restarting or generation != self._generation:
            return self._restart_error()
        return None

    def _restart_error(self) -> EngineRestarting:
        retry_after = max(_MIN_RETRY_AFTER_S, self._ready_by - time.monotonic())
        return EngineRestarting(
            f"the engine driver died ({self._last_error}) and a fresh engine is starting: retry the request",
            retry_after,
        )

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
            if (error := self._failure(channel.generation)) is not None and channel.queue.empty():
                return error

    async def _wait(self, future: asyncio.Future, generation: int) -> Any:
        while not future.done():
            await asyncio.wait((future,), timeout=_LIVENESS_POLL_S)
            if (error := self._failure(generation)) is not None and not future.done():
                raise error
        return future.result()

    # ---------------------------------------------------------------------------- driver thread

    def _supervise(self) -> None:
        """The driver thread: drives the engine; when driving dies, fails its requests and starts a fresh engine."""
        channels: dict[str, _Channel] = {}  # requests in the engine
        try:
            while True:
                try:
                    self._drive(self.engine, self._generation, channels)
                    return  # shut down
                except BaseException as exc:  # noqa: BLE001 - whatever killed the drive, a fresh engine takes over
                    self._record(exc, "the engine driver died")
                if not self._recover(channels):
                    return
        except BaseException as exc:  # noqa: BLE001 - the supervisor itself failed: nothing restarts
            self._record(exc, "the engine supervisor died")
            self._dead = EngineError(f"the engine supervisor died ({self._last_error})")
        finally:
            if self._dead is None:
                self._dead = EngineError("the engine is shut down")
            dead = self._dead
            self._fail_waiters(channels, lambda: dead)

    def _record(self, exc: BaseException, what: str) -> None:
        self._last_error = describe(exc)
        logger.error("%s: %s", what, self._last_error, exc_info=exc)
        forget_frames(exc)

    def _recover(self, channels: dict[str, _Channel]) -> bool:
        """After driving died: fail its requests, drop the dead engine, start a fresh one.

        Returns:
            True once a fresh engine serves; False to stop (shut down, or dead: ``_dead`` set).
        """
        self._restarting = True  # NOTE: first, so callers fail fast from here on
        self._engine = None  # the dead engine's KV cache and weights go with its last reference
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
            self._fail_waiters(channels, self._restart_error)
            logger.warning("starting a fresh engine in %.2f s", delay)
            if not self._wait_out(delay):
                return False
            self._restarts += 1
            self._stats = {**self._stats, "engine_restarts": self._restarts}
            release_memory()  # the dead engine's, or a failed start's
            started = time.monotonic()
            try:
                engine = Engine(config=self._restart_config)
            except BaseException as exc:  # noqa: BLE001 - a failed start counts as one more failure
                self._record(exc, "a fresh engine failed to start")
                continue
            self._load_s = time.monotonic() - started
            self._publish(engine)
            self._engine = engine
            self._generation += 1
            self._restarting = False
            logger.warning("a fresh engine serves (restart %d, started in %.2f s)", self._restarts, self._load_s)
            return not self._stopping

    def _wait_out(self, delay: float) -> bool:
        """Waits ``delay`` seconds on the inbox, answering what arrives with ``EngineRestarting``; False on shutdown."""
        until = time.monotonic() + delay
        while not self._stopping:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return True
            try:
                command = self._inbox.get(timeout=remaining)
            except queue.Empty:
                return True
            self._refuse(command, self._restart_error())
        return False

    def _fail_waiters(self, channels: dict[str, _Channel], error: Callable[[], EngineError]) -> None:
        """Answers every request, pin and queued command of an engine that is gone with ``error()``."""
        for channel in channels.values():
            channel.send(error())
        channels.clear()
        for pin in self._pin_waiters.values():
            _resolve(pin.loop, pin.future, error=error())
        self._pin_waiters.clear()
        while True:  # NOTE: commands posted before the failure was visible are answered here
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._refuse(command, error())

    @staticmethod
    def _refuse(command: Any, error: EngineError) -> None:
        if isinstance(command, _Add):
            command.channel.send(error)
        elif isinstance(command, (_Pin, _Call)):
            _resolve(command.loop, command.future, error=error)

    def _publish(self, engine: Engine) -> None:
        stats = engine.stats()
        stats["engine_restarts"] = self._restarts
        self._stats = stats

    def _drive(self, engine: Engine, generation: int, channels: dict[str, _Channel]) -> None:
        """Steps ``engine`` while there is work, between the commands of the inbox; returns on ``_Stop``."""
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
                    engine.abort_request(list(channels))
                    self._emit(generation, channels, engine.pop_deltas(), {})
                    return
                self._handle(engine, generation, command, channels, self._pin_waiters)
            deltas = engine.step_deltas()
            failures = engine.pop_failures()
            self._publish(engine)
            self._emit(generation, channels, deltas, failures)

    def _emit(
        self, generation: int, channels: dict[str, _Channel], deltas: list[Delta], failures: dict[str, EngineError]
    ) -> None:
        """Sends each request's deltas (consecutive in ``deltas``) to its channel, or settles its pin."""
        pins = self._pin_waiters
        start = 0
        for end, delta in enumerate(deltas, 1):
            # NOTE: a request's deltas end at the one with usage: should an aborted request's id
            # be reused before its last delta is sent, the two requests' deltas stay apart.
            if end < len(deltas) and deltas[end].request_id == delta.request_id and delta.usage is None:
                continue
            request_id, usage, group, start = delta.request_id, delta.usage, deltas[start:end], end
            if request_id in pins:
                if usage is not None:
                    pin = pins.pop(request_id)
                    result = PinnedPrefix(_public_pin_id(request_id, generation), len(pin.prompt_token_ids), usage.cached_tokens)
                    _resolve(pin.loop, pin.future, result, failures.get(request_id))
                continue
            channel = channels.get(request_id)
            if channel is None:
                continue
            self._release(channel)  # the request left the waiting queue (or finished)
            if usage is not None:
                del channels[request_id]
            error = failures.get(request_id)
            channel.send(error if error is not None else group)

    def _handle(
        self, engine: Engine, generation: int, command: Any, channels: dict[str, _Channel], pins: dict[str, _Pin]
    ) -> None:
        if isinstance(command, _Add):
            posted_to = command.channel.generation
        elif isinstance(command, (_Pin, _Call)):
            posted_to = command.generation
        else:  # an abort: of an id this engine does not know, a no-op
            posted_to = generation
        if posted_to != generation:  # NOTE: posted to an engine that died: never run on this one
            self._refuse(command, self._restart_error())
            return
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
            engine.abort_request(command.request_id)
            # NOTE: sent now, before a later command may reuse the id
            self._emit(generation, channels, engine.pop_deltas(), {})
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
