"""AsyncEngine: an Engine stepped by a driver thread of its own, with asyncio streams per request.

Callers never touch the Engine: they post commands (Add, Abort, Pin, ...) into a
thread-safe inbox (``engine.commands``) that the driver thread drains between steps
(``engine.driver``). Each request's deltas of a step go to an asyncio queue on the caller's
loop through ``loop.call_soon_threadsafe``: ``stream()`` yields them, ``generate()`` builds
cumulative outputs from them. Admission limits refuse a request before it queues
(``engine.admission``); the driver thread restarts an engine that died
(``engine.supervisor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from engine.admission import Admission
from engine.commands import Abort, Add, Call, Channel, Command, Pin, engine_pin_id, resolve
from engine.config import EngineConfig
from engine.errors import EngineOverloaded, EngineRestarting, ParameterError, UnsupportedTask
from engine.llm_engine import Engine
from engine.outputs import Delta, OutputAccumulator, PinnedPrefix, Received, RequestOutput
from engine.pooling.api import cosine
from engine.pooling.outputs import EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput
from engine.pooling.params import PoolingParams
from engine.pooling.pooling_queue import PoolingRequest
from engine.pooling.tokens import EmbedInput, PoolingInput, PoolingTokenizer
from engine.processor import ProcessedRequest, Prompt
from engine.sampling_params import SamplingParams
from engine.supervisor import EngineHealth, RestartPolicy, Supervisor, restart_config

_LIVENESS_POLL_S = 0.5  # a waiter re-checks the driver at least this often


class AsyncEngine:
    """The engine behind asyncio: streaming generation, abort, prefix pinning, stats; it heals itself.

    When its driver dies, a fresh ``Engine`` is loaded from the same configuration under
    ``restart`` and the requests in flight resume on it: their streams go on with no delta
    repeated or missing (``engine.resume``; with ``restart.resume`` off they fail with the
    retryable ``EngineRestarting``). Once that policy is spent the engine is dead and every
    call raises ``EngineError`` (``engine.supervisor``). ``health()`` says which.

    Each request is checked and prepared once, on the caller's side (``engine.processor``),
    before its command is posted: a bad one raises before anything reaches the driver.

    Attributes:
        tokenizer: the model's Hugging Face tokenizer, for the caller's thread(s).
        model_name, model_dir, max_model_len, accepts_images, image_placeholder: as ``Engine``'s.
        dtype, device: what the weights run in and on (every fresh engine the same): readable while one starts.

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
        load_s = time.monotonic() - started
        self.config = engine.config
        self._restart_config = restart_config(engine.config, engine.runner.num_blocks)
        # NOTE: a fresh engine has the same settings and KV cache size: this intake serves it too.
        self._processor = engine.processor.for_callers()
        self.tokenizer = self._processor.tokenizer
        self.model_name = engine.model_name
        self.model_dir = engine.model_dir
        self.dtype, self.device = engine.runner.dtype, engine.runner.device
        self.max_model_len = engine.max_model_len
        self.accepts_images = engine.accepts_images
        self.image_placeholder = engine.image_placeholder
        self.task = engine.task
        # NOTE: pooling inputs are tokenized on the callers' thread with the intake's tokenizer
        pooling = engine.pooling_tokens
        self._pooling_tokens = None if pooling is None else PoolingTokenizer(self._processor.tokenizer, pooling.config)
        self._ids = itertools.count()
        self._shares_steps = False  # see share_steps()
        self._id_prefix = uuid.uuid4().hex[:8]
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._admission = Admission(self.config.max_queued_requests, self.config.max_queued_tokens)
        self._supervisor = Supervisor(
            engine, self._start_engine, restart or RestartPolicy(), self._inbox, self._admission, load_s
        )

    def _start_engine(self) -> Engine:
        """A fresh engine for a restart: the first one's settings and KV cache size, and its shared steps."""
        engine = Engine(config=self._restart_config)
        if self._shares_steps and engine.pooling is not None:
            engine.pooling.share_steps()
        return engine

    async def share_steps(self) -> None:
        """A pooling engine beside a chat model in this process: from now on (and after a restart), while a chat
        engine of the process has requests, its turn between two chat steps runs at most that engine's
        ``pooling_time_fraction`` of a chat step, a layer of a batch at a time (``PoolingQueue``); with no chat
        request it runs whole batches of its full budget. A no-op for a generative model.

        Raises:
            EngineRestarting, EngineError: as ``call()``.
        """
        self._shares_steps = True
        await self.call(_share_steps)

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
        return self._supervisor.engine

    @property
    def is_running(self) -> bool:
        """True while an engine serves: not while a fresh one starts, once dead or shut down."""
        return self._supervisor.is_running

    def health(self) -> EngineHealth:
        """Running, restarting, dead or stopped; the restarts so far and the last fatal error."""
        return self._supervisor.health()

    def stats(self) -> dict[str, Any]:
        """The figures of ``Engine.stats()`` as published after the latest step, and ``engine_restarts``.

        A fresh engine's figures start from zero; while it starts, the dead one's last figures stay.
        ``requests_rejected`` also counts the requests ``generate`` refused before they reached
        the engine (bad options or prompt, admission limits full).
        """
        stats = self._supervisor.stats
        return {**stats, "requests_rejected": stats["requests_rejected"] + self._admission.num_rejected}

    # ---------------------------------------------------------------------------- requests

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0,
        cache_salt: str | None = None, tenant: str | None = None, weight: float = 1.0,
        resume_token_ids: Sequence[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Streams one request's cumulative outputs, one per step; the last has ``finished=True``.

        Each output is built from ``stream()``'s deltas and copies the output so far; its
        ``metrics`` is None (the latency breakdown is the last delta's ``usage.latency``).
        Arguments, errors and cancellation as ``stream()``.
        """
        shape = params if isinstance(params, SamplingParams) else SamplingParams()  # NOTE: _steps refuses the rest
        accumulator = OutputAccumulator(shape.n, shape.logprobs is not None)
        steps = self._steps(prompt, params, request_id, priority, cache_salt, tenant, weight, resume_token_ids)
        async with contextlib.aclosing(steps):
            async for deltas in steps:
                for delta in deltas:
                    accumulator.add(delta)
                yield accumulator.output()

    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0,
        cache_salt: str | None = None, tenant: str | None = None, weight: float = 1.0,
        resume_token_ids: Sequence[int] | None = None,
    ) -> AsyncIterator[Delta]:  # fmt: skip
        """Streams one request's deltas: per step, one per completion that progressed; the last has ``usage``.

        Closing or cancelling the iterator aborts the request and frees its blocks.
        ``tenant`` and ``weight`` are the fair share's (``Engine.add_request``).
        ``resume_token_ids`` continues a run whose caller already got those output tokens (a request
        journalled by a server that shut down): they are its output so far, recomputed as a prefill
        (the prefix cache serves what it holds), and its deltas carry only what follows (``n == 1`` only).

        Raises:
            RequestRejected: From the first ``__anext__``: empty prompt, a token id outside
                the vocabulary, longer than max_model_len or than the KV cache holds; images the model
                cannot take (field ``multi_modal_data.image``, ``Processor.process_prompt``).
            EngineOverloaded: From the first ``__anext__``: admission limits are full.
            ParameterError: Bad ``params``, ``request_id``, ``priority``, ``cache_salt``,
                ``tenant``, ``weight`` or ``resume_token_ids``, a request id already in use, or a structured-output constraint that does not
                compile (compiled on the compiler's threads, never on the step loop).
            EngineRestarting: A fresh engine is starting; or the driver died while the request
                was queued or running and it is not resumed (``RestartPolicy.resume`` off, ``n > 1``): retry it.
            RequestPoisoned: The request was in flight at too many driver deaths (``engine.resume``).
            EngineError: The engine failed this request, or is dead / shut down.
        """
        steps = self._steps(prompt, params, request_id, priority, cache_salt, tenant, weight, resume_token_ids)
        async with contextlib.aclosing(steps):
            async for deltas in steps:
                for delta in deltas:
                    yield delta

    async def _steps(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, priority: int,
        cache_salt: str | None, tenant: str | None, weight: float, resume_token_ids: Sequence[int] | None = None,
    ) -> AsyncIterator[list[Delta]]:  # fmt: skip
        """The request's deltas, a step's at a time (see ``stream``)."""
        supervisor = self._supervisor
        generation = supervisor.check_alive()
        if request_id is None:
            request_id = f"{self._id_prefix}-{next(self._ids)}"
        try:
            request = await self._processor.process_async(
                request_id, prompt, params, priority, cache_salt, tenant=tenant, weight=weight
            )
            received = None if resume_token_ids is None else self._received(request, resume_token_ids)
            channel = Channel(asyncio.get_running_loop(), len(request.prompt_token_ids), generation)
            self._admission.admit(request_id, channel)
        except (ParameterError, EngineOverloaded):
            self._admission.reject()
            raise
        try:
            self._inbox.put(Add(request, channel, received))
            if (error := supervisor.channel_failure(channel)) is not None:
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
            if not channel.finished and supervisor.health().status in ("running", "restarting"):
                self._inbox.put(Abort(request_id))  # NOTE: while restarting, noted for the request's resume
            self._admission.end(request_id, channel)

    def _received(self, request: ProcessedRequest, token_ids: Sequence[int]) -> Received:
        """What the caller of a continued run got, checked against the request it continues."""
        processor = self._processor
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise ParameterError("resume_token_ids", "resume_token_ids must be a list of token ids")
        if request.params.n != 1:
            raise ParameterError("resume_token_ids", f"resume_token_ids continues one completion; got n={request.params.n}")
        if len(request.prompt_token_ids) + len(token_ids) >= processor.max_model_len:
            raise ParameterError("resume_token_ids", "resume_token_ids and the prompt fill max_model_len")
        if not all(type(t) is int and 0 <= t < processor.vocab_size for t in token_ids):
            raise ParameterError("resume_token_ids", f"resume_token_ids must be token ids in [0, {processor.vocab_size})")
        return Received(list(token_ids))

    async def embed(
        self, prompt: EmbedInput, pooling_params: PoolingParams | None = None, request_id: str | None = None
    ) -> EmbeddingRequestOutput:
        """One input's embedding; concurrent calls run together in token-budget batches.

        Raises:
            UnsupportedTask: the model does not embed; ParameterError / RequestRejected: as ``Engine.embed``.
            EngineRestarting, EngineError: as ``call()``.
        """
        tokens = self._pooling_intake("embed")
        params = tokens.check(pooling_params)
        [item] = tokens.embed_inputs([prompt], params)
        return await self._pool("embed", item, params, request_id)

    async def score(
        self, query: str, document: str, pooling_params: PoolingParams | None = None, request_id: str | None = None
    ) -> ScoringRequestOutput:
        """One document's relevance to ``query``, as ``Engine.score``; concurrent calls run together.

        Raises:
            UnsupportedTask: a generative model; ParameterError / RequestRejected: as ``Engine.score``.
        """
        if self.task == "embed":
            q, d = await asyncio.gather(self.embed(query, pooling_params), self.embed(document, pooling_params))
            score = cosine(q.outputs.embedding, d.outputs.embedding)
            return ScoringRequestOutput(request_id or d.request_id, d.prompt_token_ids, ScoringOutput(score))
        tokens = self._pooling_intake("score")
        params = tokens.check(pooling_params)
        [item] = tokens.pair_inputs(query, [document], params)
        return await self._pool("score", item, params, request_id)

    def _pooling_intake(self, task: str) -> PoolingTokenizer:
        if self._pooling_tokens is None or (task == "embed" and self.task != "embed"):
            raise UnsupportedTask(self.model_name, task, self.task)
        return self._pooling_tokens

    async def _pool(self, kind: str, item: PoolingInput, params: PoolingParams, request_id: str | None) -> Any:
        generation = self._supervisor.check_alive()
        loop = asyncio.get_running_loop()
        result = loop.create_future()

        def on_done(out: Any) -> None:  # driver thread
            resolve(loop, result, error=out) if isinstance(out, BaseException) else resolve(loop, result, out)

        arrival = time.monotonic()

        def add(engine: Engine) -> None:
            rid = request_id if request_id is not None else f"{self._id_prefix}-{engine.pooling.next_id()}"
            engine.pooling.add(PoolingRequest(rid, kind, item, params, on_done, arrival))

        await self.call(add)
        return await self._wait(result, generation)

    async def abort(self, request_id: str) -> None:
        """Aborts a request (its stream ends with finish_reason "abort"); unknown ids are a no-op."""
        if self.health().status in ("running", "restarting"):
            self._inbox.put(Abort(request_id))

    async def pin_prefix(self, prompt: Prompt, cache_salt: str | None = None) -> PinnedPrefix:
        """Computes the prompt's KV once and keeps its blocks referenced until ``unpin_prefix``.

        A pin lives as long as its engine: after a restart the prefix is no longer held (its
        id unpins nothing), and requests compute it again.

        Raises:
            RequestRejected: The prompt can never be served.
            ParameterError: ``cache_salt`` is of the wrong type or too long.
            EngineRestarting: The driver died while pinning, or a fresh engine is starting.
            EngineError: The engine failed the pin, or is dead.
        """
        generation = self._supervisor.check_alive()
        request = await self._processor.process_async(None, prompt, cache_salt=cache_salt, pin=True)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(Pin(request, generation, loop, future))
        return await self._wait(future, generation)

    async def unpin_prefix(self, pin_id: str) -> None:
        """Releases a pinned prefix; its blocks stay cached until evicted.

        Unknown ids, and pins of an engine that died, are a no-op.
        """
        engine_id, generation = engine_pin_id(pin_id)
        if self._supervisor.failure(generation) is None:
            driver = self._supervisor.driver
            with contextlib.suppress(EngineRestarting):  # NOTE: the pin died with its engine
                await self.call(lambda engine: driver.unpin(engine, engine_id))

    async def aclose(self) -> None:
        """Aborts every request, closes the engine (``Engine.close``: saves to ``kv_cache_dir``) and stops the
        driver thread (a restart in progress ends first); idempotent."""
        self._supervisor.stop()
        await asyncio.to_thread(self._supervisor.join)

    async def shutdown(self) -> None:
        """``aclose()``, under the name vLLM's engines use."""
        await self.aclose()

    def close(self) -> None:
        """``aclose()`` from synchronous code: blocks until the driver thread has ended."""
        self._supervisor.stop()
        self._supervisor.join()

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Runs ``fn(engine)`` on the driver thread between two steps and returns its result.

        The one way to read or change the ``Engine`` behind this object (inspection in tests,
        maintenance): nothing else touches it while ``fn`` runs.

        Raises:
            EngineRestarting: The driver died before ``fn`` ran, or a fresh engine is starting.
            EngineError: The engine is dead or shut down; whatever ``fn`` raised.
        """
        generation = self._supervisor.check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(Call(fn, generation, loop, future))
        return await self._wait(future, generation)

    # ---------------------------------------------------------------------------- caller side

    # NOTE: both waits poll with asyncio.wait, not wait_for: on Python 3.11 wait_for returns
    # the result and drops the caller's cancellation when both land in one loop iteration, so
    # a cancelled consumer would go on reading (and its request would never be aborted).

    async def _next(self, channel: Channel) -> list[Delta] | BaseException:
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
            if (error := self._supervisor.channel_failure(channel)) is not None and channel.queue.empty():
                return error

    async def _wait(self, future: asyncio.Future, generation: int) -> Any:
        while not future.done():
            await asyncio.wait((future,), timeout=_LIVENESS_POLL_S)
            if (error := self._supervisor.failure(generation)) is not None and not future.done():
                raise error
        return future.result()


def _share_steps(engine: Engine) -> None:
    """Driver thread: the engine's pooling queue yields to the process's chat engines (``AsyncEngine.share_steps``)."""
    if engine.pooling is not None:
        engine.pooling.share_steps()
