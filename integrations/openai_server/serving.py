"""The glue between the HTTP routes and the SDK: every request runs through an ``sdk.AsyncClient``.

One engine per server; one SDK client per tenant over a shared in-process transport, so the
SDK hooks (filters, audit) see every HTTP request with its tenant id, and the tenant's policy
(priority cap, fair-share weight, rate limits, cache isolation) holds as it does in process.
The routes read the engine's own ``Delta``s as the SDK passes them on (tool calls, logprobs,
prompt token ids, the completion index: ``n`` > 1 is the engine's); a completions request with
several prompts runs one SDK request per prompt, its deltas' indexes shifted to the choice's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from engine.supervisor import EngineHealth, RestartPolicy
from sdk.chat_template import longest_token_chars
from sdk.client import AsyncClient
from sdk.hooks import Hook, RequestOrigin
from sdk.images import ImageLimits
from sdk.policy import TenantPolicy
from sdk.reasoning import reasoning_format
from sdk.rate_limit import RateLimiter
from sdk.settings import ClientSettings
from sdk.transport import InProcessTransport
from sdk.types import ChatRequest, CompletionRequest, Delta


class Serving:
    """The engine, its transport and the per-tenant SDK clients of one server.

    Args:
        engine: a started ``engine.AsyncEngine``; owned (shut down by ``close()``) when ``owns_engine``.
        hooks: SDK hooks run on every request.
        served_model_name: the model id clients use; defaults to the engine's model name.
        reasoning_parser: how chat replies' reasoning is split from their content
            (``sdk.reasoning.REASONING_PARSERS``; ``"auto"`` reads the chat template).
        image_limits: what a request's images may be (``sdk.images.ImageLimits``); None = its defaults.
    """

    def __init__(
        self,
        engine: Any,
        *,
        hooks: Sequence[Hook] = (),
        served_model_name: str | None = None,
        owns_engine: bool = True,
        reasoning_parser: str = "auto",
        image_limits: ImageLimits | None = None,
    ) -> None:
        self.engine = engine
        self._transport = InProcessTransport(engine, reasoning_parser, image_limits)
        self._settings = ClientSettings(transport=self._transport, hooks=hooks, route="http")  # client() adds a tenant and its policy
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
        restart: RestartPolicy | None = None,
        reasoning_parser: str = "auto",
        image_limits: ImageLimits | None = None,
        **engine_config: Any,
    ) -> Serving:
        """Load a new engine (blocks while the weights load; call from a thread); ``restart``: its self-healing."""
        from engine import AsyncEngine

        engine = AsyncEngine(model, restart=restart, **engine_config)
        return cls(
            engine, hooks=hooks, served_model_name=served_model_name, reasoning_parser=reasoning_parser,
            image_limits=image_limits,
        )  # fmt: skip

    async def start(self) -> None:
        """Start the transport and read the vocabulary's longest token, while /health still says starting.

        The prompt bound (``sdk.chat_template.check_prompt_chars``) needs it for the first long
        prompt; reading it holds the GIL for about 0.1 s, which no request should wait for.
        """
        await self._transport.start()
        await asyncio.to_thread(longest_token_chars, self.engine.tokenizer)

    @property
    def model_name(self) -> str:
        return self._served_name or self.engine.model_name

    @property
    def is_pooling(self) -> bool:
        """The model embeds or scores (an embedder, a reranker) rather than generates."""
        return getattr(self.engine, "task", "generate") != "generate"

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def health(self) -> EngineHealth:
        """The engine's ``health()``: running, restarting (after its driver died), dead or stopped.

        An engine without ``health()`` (a stand-in) is running while its ``is_running`` says so.
        """
        health = getattr(self.engine, "health", None)
        if health is not None:
            return health()
        return EngineHealth("running" if getattr(self.engine, "is_running", True) else "dead")

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    @property
    def parses_reasoning(self) -> bool:
        """Chat replies have their reasoning split out of their text (the chat template is a thinking model's)."""
        template = getattr(getattr(self.engine, "tokenizer", None), "chat_template", None)
        return reasoning_format(self._transport.reasoning_parser, template) is not None

    async def close(self) -> None:
        if self._owns_engine:
            await self.engine.shutdown()

    def client(self, tenant: str, policy: TenantPolicy) -> AsyncClient:
        """The tenant's SDK client, made with ``policy`` on its first request."""
        client = self._clients.get(tenant)
        if client is None:
            client = AsyncClient(settings=dataclasses.replace(self._settings, tenant=tenant, policy=policy))
            self._clients[tenant] = client
        return client

    def limiter(self, tenant: str) -> RateLimiter | None:
        """The tenant's rate state, once it has made a request under a policy with limits."""
        client = self._clients.get(tenant)
        return None if client is None else client.limiter

    async def open(
        self,
        client: AsyncClient,
        request_id: str,
        requests: Sequence[ChatRequest | CompletionRequest],
        origin: RequestOrigin | None = None,
        resume_token_ids: list[int] | None = None,
    ) -> AsyncIterator[Delta]:
        """Start ``requests`` (a chat, or one per prompt of a completion) and merge their deltas.

        ``resume_token_ids`` (one request of ``n == 1`` only) continues a run whose caller already
        got those output tokens (``AsyncClient.stream``): its deltas carry only what follows.

        Completion ``i`` of request ``p`` is choice ``p * n + i``, the deltas' ``index``. Every
        request's first delta is awaited here, so validation, filter and admission errors raise
        from this call (before any response is sent). Closing the returned iterator aborts what
        still runs.

        Raises:
            sdk.errors.PagedError: as ``sdk.AsyncClient.stream``.
        """
        streams: list[AsyncIterator[Delta]] = []
        for p, request in enumerate(requests):
            rid = request_id if len(requests) == 1 else f"{request_id}/{p}"
            request = request.model_copy(update={"request_id": rid})
            streams.append(self._choices(client, p * (request.n or 1), request, origin, resume_token_ids))
        firsts = await _first_outputs(streams)
        streams = [_prepend(first, stream) for first, stream in zip(firsts, streams)]
        return streams[0] if len(streams) == 1 else _merge(streams)

    async def _choices(
        self, client: AsyncClient, first_index: int, request: ChatRequest | CompletionRequest,
        origin: RequestOrigin | None, resume_token_ids: list[int] | None,
    ) -> AsyncIterator[Delta]:  # fmt: skip
        if isinstance(request, ChatRequest):
            deltas = client.stream(request, origin=origin, resume_token_ids=resume_token_ids)
        else:
            deltas = client.stream(prompt=request, origin=origin, resume_token_ids=resume_token_ids)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                delta.index += first_index
                yield delta


async def _first_outputs(streams: list[AsyncIterator[Delta]]) -> list[Delta]:
    """Every stream's first delta, awaited together (choices start in the same engine step).

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


async def _prepend(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    async with contextlib.aclosing(rest):
        yield first
        async for delta in rest:
            yield delta


async def _merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """Deltas of several streams as they come; closing it cancels and closes them all."""
    pending: dict[asyncio.Future, AsyncIterator[Delta]] = {
        asyncio.ensure_future(anext(s)): s for s in streams
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                stream = pending.pop(future)
                try:
                    delta = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(stream))] = stream
                yield delta
    finally:
        for future in pending:
            future.cancel()
        for future in pending:
            with contextlib.suppress(BaseException):
                await future
        for stream in streams:
            await stream.aclose()
