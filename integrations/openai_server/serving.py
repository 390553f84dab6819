"""The glue between the HTTP routes and the SDK: every request runs through an ``sdk.AsyncClient``.

One engine per server; one SDK client per tenant over a shared in-process transport, so the
SDK hooks (filters, audit) see every HTTP request with its tenant id. Two things the SDK
does not carry are handled here: ``n`` > 1 runs n SDK requests (seeds ``seed + i``; they
share the prompt's cached blocks), and logprobs / prompt token ids are read off the engine's
outputs by a thin proxy (``_EngineTap``) keyed by request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sdk.client import AsyncClient
from sdk.hooks import Hook
from sdk.transport import InProcessTransport
from sdk.types import ChatMessage, Usage


@dataclass(slots=True)
class TokenInfo:
    """A generated token's logprob and its top candidates (decoded strings)."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(slots=True)
class Chunk:
    """New output of one choice; ``finish_reason`` and ``usage`` are set on its last chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenInfo] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    prompt_token_ids: Sequence[int] | None = None


@dataclass(slots=True)
class _Tap:
    logprobs: int | None
    prompt_token_ids: Sequence[int] = ()
    pending: deque = field(default_factory=deque)  # per-token logprob dicts not yet consumed


class _EngineTap:
    """Proxy over ``AsyncEngine``: asks for logprobs where a request wants them and records outputs."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.taps: dict[str, _Tap] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt: Any, params: Any, request_id: str | None = None, **kwargs: Any):
        tap = self.taps.get(request_id) if request_id is not None else None
        if tap is not None and tap.logprobs is not None:
            params = dataclasses.replace(params, logprobs=tap.logprobs)
        stream = self._engine.generate(prompt, params, request_id=request_id, **kwargs)
        seen = 0
        try:
            async for out in stream:
                if tap is not None:
                    tap.prompt_token_ids = out.prompt_token_ids
                    logprobs = out.outputs[0].logprobs
                    if logprobs:
                        tap.pending.extend(logprobs[seen:])
                        seen = len(logprobs)
                yield out
        finally:
            await stream.aclose()


class Serving:
    """The engine, its transport and the per-tenant SDK clients of one server.

    Args:
        engine: a started ``engine.AsyncEngine``; owned (shut down by ``close()``) when ``owns_engine``.
        hooks: SDK hooks run on every request.
        served_model_name: the model id clients use; defaults to the engine's model name.
    """

    def __init__(
        self,
        engine: Any,
        *,
        hooks: Sequence[Hook] = (),
        served_model_name: str | None = None,
        owns_engine: bool = True,
    ) -> None:
        self.engine = engine
        self._tap = _EngineTap(engine)
        self._transport = InProcessTransport(engine=self._tap)
        self._hooks = tuple(hooks)
        self._served_name = served_model_name
        self._owns_engine = owns_engine
        self._clients: dict[str, AsyncClient] = {}

    @classmethod
    def create(
        cls,
        model: str | None = None,
        *,
        hooks: Sequence[Hook] = (),
        served_model_name: str | None = None,
        **engine_config: Any,
    ) -> Serving:
        """Load a new engine (blocks while the weights load; call from a thread)."""
        from engine import AsyncEngine

        return cls(AsyncEngine(model, **engine_config), hooks=hooks, served_model_name=served_model_name)

    async def start(self) -> None:
        await self._transport.start()

    @property
    def model_name(self) -> str:
        return self._served_name or self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def is_running(self) -> bool:
        return bool(getattr(self.engine, "is_running", True))

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def close(self) -> None:
        if self._owns_engine:
            await self.engine.shutdown()

    def client(self, tenant: str) -> AsyncClient:
        client = self._clients.get(tenant)
        if client is None:
            client = AsyncClient(transport=self._transport, hooks=self._hooks, tenant=tenant, route="http")
            self._clients[tenant] = client
        return client

    async def open(
        self,
        tenant: str,
        request_id: str,
        *,
        messages: list[ChatMessage] | None = None,
        prompts: Sequence[str | list[int]] = (),
        n: int = 1,
        logprobs: int | None = None,
        options: dict[str, Any],
    ) -> AsyncIterator[Chunk]:
        """Start ``n`` choices of a chat (``messages``) or of each prompt, and merge their chunks.

        Choice ``i`` of input ``p`` has index ``p * n + i``. Every choice's first output is
        awaited here, so validation, filter and admission errors raise from this call
        (before any response is sent). Closing the returned iterator aborts what still runs.

        Raises:
            sdk.errors.PagedError: as ``sdk.AsyncClient.stream``.
        """
        client = self.client(tenant)
        inputs: list[Any] = [messages] if messages is not None else list(prompts)
        streams: list[AsyncIterator[Chunk]] = []
        for p, payload in enumerate(inputs):
            for i in range(n):
                index = p * n + i
                rid = request_id if len(inputs) * n == 1 else f"{request_id}/{index}"
                opts = dict(options, request_id=rid)
                if i and opts.get("seed") is not None:
                    opts["seed"] += i
                streams.append(self._choice(client, index, messages is not None, payload, logprobs, opts))
        firsts = await _first_outputs(streams)
        streams = [_prepend(first, stream) for first, stream in zip(firsts, streams)]
        return streams[0] if len(streams) == 1 else _merge(streams)

    async def _choice(
        self,
        client: AsyncClient,
        index: int,
        is_chat: bool,
        payload: Any,
        logprobs: int | None,
        options: dict[str, Any],
    ) -> AsyncIterator[Chunk]:
        request_id = options["request_id"]
        tap = self._tap.taps[request_id] = _Tap(logprobs)
        try:
            if is_chat:
                deltas = client.stream(payload, **options)
            else:
                deltas = client.stream(prompt=payload, **options)
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    infos = None
                    if logprobs is not None:
                        infos = [
                            _token_info(tap.pending.popleft(), t, logprobs)
                            for t in delta.token_ids
                            if tap.pending
                        ]
                    yield Chunk(
                        index=index,
                        text=delta.text,
                        token_ids=delta.token_ids,
                        logprobs=infos,
                        finish_reason=delta.finish_reason,
                        usage=delta.usage,
                        prompt_token_ids=tap.prompt_token_ids,
                    )
        finally:
            del self._tap.taps[request_id]


def _token_info(entry: dict[int, Any], token_id: int, k: int) -> TokenInfo:
    """The sampled token's logprob and the ``k`` top candidates (by rank) of one logprobs entry."""
    sampled = entry.get(token_id)
    top = sorted(entry.items(), key=lambda kv: kv[1].rank)
    return TokenInfo(
        token=sampled.decoded_token if sampled is not None else "",
        logprob=sampled.logprob if sampled is not None else float("-inf"),
        top=[(lp.decoded_token, lp.logprob) for _, lp in top[:k]],
    )


async def _first_outputs(streams: list[AsyncIterator[Chunk]]) -> list[Chunk]:
    """Every stream's first chunk, awaited together (choices start in the same engine step).

    On any error or cancellation every stream is closed (aborting its request) and the
    first error is raised.
    """
    if len(streams) == 1:
        try:
            return [await anext(streams[0])]
        except BaseException:
            await streams[0].aclose()
            raise
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        await asyncio.wait(tasks)
        for task in tasks:
            task.result()  # raises the first error, in choice order
    except BaseException:
        for task in tasks:
            task.cancel()
        # NOTE: a generator cannot be closed while its anext() still runs in a task.
        await asyncio.wait(tasks)
        for stream in streams:
            await stream.aclose()
        raise
    return [task.result() for task in tasks]


async def _prepend(first: Chunk, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    async with contextlib.aclosing(rest):
        yield first
        async for chunk in rest:
            yield chunk


async def _merge(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[Chunk]:
    """Chunks of several streams as they come; closing it cancels and closes them all."""
    pending: dict[asyncio.Future, AsyncIterator[Chunk]] = {
        asyncio.ensure_future(anext(s)): s for s in streams
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                stream = pending.pop(future)
                try:
                    chunk = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(stream))] = stream
                yield chunk
    finally:
        for future in pending:
            future.cancel()
        for future in pending:
            with contextlib.suppress(BaseException):
                await future
        for stream in streams:
            await stream.aclose()
