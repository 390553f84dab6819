"""One request's path through ``AsyncClient``: terms, hooks, prompt, engine, deltas, audit.

``RequestRun.deltas()`` is what ``AsyncClient.stream`` returns; its steps, in order:

1. ``terms``: the tenant's policy (``sdk.policy.request_terms``), the prompt's size and the
   rate limit. A request refused here reaches no hook: the checks are cheap and come first,
   so a flood or a huge prompt costs no filter and no audit write.
2. ``_engine_request``: the input hooks, then the prompt rendered and the engine request built.
3. ``_relay``: each delta of the transport through the chunk hooks to the caller, the
   context kept up to date; an output filter's stop ends the stream.
4. ``_finish``: whatever happened, the lease is settled, the engine request aborted if it
   still runs, and the finish hooks (audit) run once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sdk.errors import EngineRestarting, OverloadedError, RequestJournalled, RequestTimeout
from sdk.hooks import HookChain, ModelSource, RequestContext, RequestOrigin
from sdk.hooks.replay import model_source
from sdk.policy import ENGINE_MAX_TOKENS, TenantPolicy, Terms, request_terms
from sdk.prefix import PinnedPrefixes
from sdk.rate_limit import Lease, RateLimiter
from sdk.reattach import fetch_result, rest_of
from sdk.tools import to_tool_choice
from sdk.transport import EngineRequest, Transport
from sdk.types import ChatRequest, CompletionRequest, Delta, SamplingOptions, Usage

RETRY_BACKOFF = 0.05  # seconds, doubled per retry of an overloaded or restarting engine


class Startup:
    """Starts a client's transport once (loads the engine or connects), and knows the engine that serves."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.is_started = False
        self.model_source: ModelSource | None = None
        """The in-process engine that serves (after the start); None for a remote one."""

    async def __call__(self) -> ModelSource | None:
        """Start the transport unless it started; the model source. Idempotent."""
        if not self.is_started:
            await self.transport.start()
            self.model_source = model_source(self.transport)
            self.is_started = True
        return self.model_source


@dataclass(frozen=True, slots=True)
class RequestScope:
    """What a client's requests run under: the client builds it once, and each ``RequestRun`` reads it."""

    transport: Transport
    hooks: HookChain
    tenant: str | None
    policy: TenantPolicy | None
    limiter: RateLimiter | None  # the tenant's rate state; None without limits
    route: str
    max_retries: int
    prefixes: PinnedPrefixes  # credited with each finished request's prompt
    startup: Startup  # run before each request: the first one starts the transport


class RequestRun:
    """One chat or completion request, from its checks to its audit record.

    Args:
        scope: the transport, hooks, policy and limits the request runs under.
        request: the typed request, options applied.
        origin: who sent it, for the hooks' context.
    """

    def __init__(
        self, scope: RequestScope, request: ChatRequest | CompletionRequest, origin: RequestOrigin | None,
        resume_token_ids: list[int] | None = None,
    ) -> None:  # fmt: skip
        self.scope = scope
        self.request = request
        self.origin = origin or RequestOrigin()
        self.resume_token_ids = resume_token_ids
        self.in_engine = False  # the engine holds the request: abort it unless it finished
        self.num_prompt_tokens = self.num_cached_tokens = self.num_completion_tokens = 0

    async def deltas(self) -> AsyncIterator[Delta]:
        """The request's deltas; the last has ``usage`` (see ``AsyncClient.stream``)."""
        scope, request = self.scope, self.request
        model_source = await scope.startup()
        terms = request_terms(scope.policy, scope.tenant, request)
        await scope.transport.check_prompt_size(_num_chars(request))
        sampling = request.sampling(terms.max_tokens)
        ctx = self._context(sampling, model_source)
        lease = scope.limiter.enter() if scope.limiter is not None else None
        try:
            engine_request = await self._engine_request(ctx, terms, sampling, lease)
            deadline = None if request.timeout is None else time.monotonic() + request.timeout
            stream = await self._open(engine_request, deadline)
            self.in_engine = True
            try:
                async for delta in self._relay(ctx, stream, deadline):
                    yield delta
            finally:
                await stream.aclose()
        except RequestTimeout as exc:  # a remote server's 408
            ctx.error = exc
            raise
        except TimeoutError as exc:
            # NOTE: the hooks see the error the caller gets: one type per failure wherever it is seen
            timeout = RequestTimeout(f"request {ctx.request_id} timed out after {request.timeout}s")
            ctx.error = timeout
            raise timeout from exc
        except BaseException as exc:  # also GeneratorExit / CancelledError: the caller went away
            ctx.error = exc
            raise
        finally:
            await self._finish(ctx, lease)

    def _context(self, sampling: SamplingOptions, model_source: ModelSource | None) -> RequestContext:
        """What the hooks see of the request; ``params`` are the knobs sent, caps applied."""
        request, scope, origin = self.request, self.scope, self.origin
        is_chat = isinstance(request, ChatRequest)
        num_choices = request.n or 1
        return RequestContext(
            request_id=request.request_id or f"{'chat' if is_chat else 'cmpl'}-{uuid.uuid4().hex}",
            model=scope.transport.model_name,
            route=scope.route,
            kind="chat" if is_chat else "completion",
            params=sampling.sampling_kwargs(),
            tenant=scope.tenant,
            client_address=origin.client_address,
            headers=origin.headers,
            messages=list(request.messages) if is_chat else None,  # type: ignore[union-attr]
            prompt=None if is_chat else request.prompt,  # type: ignore[union-attr]
            output_pieces=[[] for _ in range(num_choices)],
            reasoning_pieces=[[] for _ in range(num_choices)],
            tool_call_deltas=[[] for _ in range(num_choices)],
            model_source=model_source,
            output_token_ids=[[] for _ in range(num_choices)],
        )

    async def _engine_request(
        self, ctx: RequestContext, terms: Terms, sampling: SamplingOptions, lease: Lease | None
    ) -> EngineRequest:
        """Runs the input hooks, renders the prompt they leave and takes its tokens from the rate limit."""
        scope, request = self.scope, self.request
        await scope.hooks.on_request(ctx)
        is_chat = isinstance(request, ChatRequest)
        tools = request.tools if is_chat else None  # type: ignore[union-attr]
        template_kwargs = request.chat_template_kwargs if is_chat else None  # type: ignore[union-attr]
        prompt = await scope.transport.prepare_prompt(scope.tenant, ctx.messages, ctx.prompt, tools, template_kwargs)
        ctx.images = await scope.transport.prompt_images(prompt)
        if lease is not None:
            lease.take_tokens(_num_reserved_tokens(prompt, request.n, terms.max_tokens))
        ctx.engine_request = EngineRequest(
            ctx.request_id, prompt, sampling, terms.priority, terms.cache_salt,
            tenant=scope.tenant, weight=terms.weight, response_format=request.response_format, tools=tools,
            tool_choice=_tool_choice(request), parallel_tool_calls=getattr(request, "parallel_tool_calls", None) is not False,
            chat_template_kwargs=template_kwargs, reasoning=scope.transport.prompt_reasoning(prompt) if is_chat else None,
            resume_token_ids=self.resume_token_ids,
        )  # fmt: skip
        return ctx.engine_request

    async def _open(self, request: EngineRequest, deadline: float | None) -> AsyncIterator[Delta]:
        """Start the request in the engine and wait for its first delta.

        Up to ``max_retries`` times, with doubling backoff, it retries a request the engine
        refused as overloaded or rate-limited, or lost to a restart (``EngineRestarting``),
        waiting at least the ``retry_after`` of the latter two: nothing was streamed to the
        caller yet, so a retry is invisible to it. A retry that could not start before
        ``deadline`` is not tried. A request a server journalled before its first output
        (``RequestJournalled``) is fetched whole from the restarted server (``sdk.reattach``).
        """
        max_retries = self.scope.max_retries
        for attempt in range(max_retries + 1):
            stream = self.scope.transport.generate(request)
            try:
                first = await _next(stream, deadline)
            except RequestJournalled as exc:  # cut off before its first output: the whole result is the rest
                await stream.aclose()  # type: ignore[attr-defined]
                if max_retries == 0:
                    raise
                result = await fetch_result(self.scope.transport, exc.request_id, max_retries, deadline)
                return _prepend(rest_of(result, request.request_id, "", "", []), _nothing())
            except (OverloadedError, EngineRestarting) as exc:
                await stream.aclose()  # type: ignore[attr-defined]
                # NOTE: a rate limit (remote) or a restart says how long to wait: never retry sooner
                delay = max(RETRY_BACKOFF * 2**attempt, getattr(exc, "retry_after", 0.0))
                if attempt == max_retries or (deadline is not None and time.monotonic() + delay >= deadline):
                    raise
                await asyncio.sleep(delay)
                continue
            return _prepend(first, stream)
        raise AssertionError("unreachable")

    async def _relay(self, ctx: RequestContext, stream: AsyncIterator[Delta], deadline: float | None) -> AsyncIterator[Delta]:
        """The transport's deltas through the chunk hooks; a hook's stop ends them with ``content_filter``."""
        while (delta := await self._next_or_rest(ctx, stream, deadline)) is not None:
            if delta.prompt_token_ids is not None:
                ctx.prompt_token_ids = list(delta.prompt_token_ids)
                self.num_prompt_tokens, self.num_cached_tokens = len(delta.prompt_token_ids), delta.num_cached_tokens or 0
            self.num_completion_tokens += len(delta.token_ids)
            # NOTE: the engine's usage comes on the last delta; until then the hooks see the counts so far
            ctx.usage = delta.usage or Usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)
            if (delta.text or delta.reasoning or delta.token_ids or delta.tool_calls) and await self.scope.hooks.on_chunk(ctx, delta) is not None:
                ctx.finish_reason = "content_filter"
                yield Delta(ctx.request_id, delta.index, prompt_token_ids=delta.prompt_token_ids,
                            finish_reason="content_filter", usage=ctx.usage)  # fmt: skip
                return
            if ctx.first_token_monotonic is None:
                ctx.first_token_monotonic = time.monotonic()
            ctx.output_pieces[delta.index].append(delta.text)
            ctx.reasoning_pieces[delta.index].append(delta.reasoning)
            ctx.output_token_ids[delta.index] += delta.token_ids
            ctx.tool_call_deltas[delta.index] += delta.tool_calls or ()
            if delta.finish_reason is not None:
                ctx.finish_reason = delta.finish_reason  # type: ignore[assignment]
            if delta.usage is not None:  # the request's last delta: it finished in the engine
                self.in_engine = False
            yield delta

    async def _next_or_rest(self, ctx: RequestContext, stream: AsyncIterator[Delta], deadline: float | None) -> Delta | None:
        """The stream's next delta; for a stream a server journalled as it shut down, with ``max_retries``, the
        rest of the whole result once a restarted server has it (``sdk.reattach``), as the last delta."""
        try:
            return await _next(stream, deadline)
        except RequestJournalled as exc:
            if self.scope.max_retries == 0 or len(ctx.output_pieces) != 1:
                raise
            result = await fetch_result(self.scope.transport, exc.request_id, self.scope.max_retries, deadline)
            rest = rest_of(
                result, ctx.request_id, "".join(ctx.output_pieces[0]), "".join(ctx.reasoning_pieces[0]),
                ctx.output_token_ids[0],
            )  # fmt: skip
            if rest is None:
                raise
            return rest

    async def _finish(self, ctx: RequestContext, lease: Lease | None) -> None:
        await end_request(self.scope, ctx, lease, in_engine=self.in_engine)


async def end_request(scope: RequestScope, ctx: RequestContext, lease: Lease | None, *, in_engine: bool = False) -> None:
    """Whatever happened to a request (chat, completion or pooling): its lease settled with the tokens it used,
    the engine request aborted if it still runs (``in_engine``), and the finish hooks (audit) run once."""
    if lease is not None:
        lease.release(ctx.usage.total_tokens)
    if in_engine:
        await scope.transport.abort(ctx.request_id)
    if ctx.finish_reason is None and (in_engine and ctx.error is not None or _abandoned(ctx.error)):
        ctx.finish_reason = "abort"  # NOTE: wherever it was: queued, rendering or in the engine
    ctx.end_monotonic = time.monotonic()
    scope.prefixes.count_hits(ctx.prompt_token_ids or (), ctx.usage.cached_tokens)
    await scope.hooks.on_finish(ctx)


def _abandoned(error: BaseException | None) -> bool:
    """Whether ``error`` means the caller gave the request up: cancelled, timed out, or its stream closed."""
    return isinstance(error, (asyncio.CancelledError, GeneratorExit, TimeoutError))


def _num_chars(request: ChatRequest | CompletionRequest) -> int:
    """Characters of a request's text: its messages' text, or its prompt string (0 for token ids)."""
    if isinstance(request, ChatRequest):
        return sum(len(m.text) for m in request.messages)
    return len(request.prompt) if isinstance(request.prompt, str) else 0


def _num_reserved_tokens(prompt: str | list[int], n: int | None, max_tokens: int | None) -> int:
    """Tokens a request reserves from a tokens-per-minute limit: its prompt plus what its completions may add.

    A prompt still in text (a remote transport renders it) counts a token per four characters.
    """
    num_prompt = len(prompt) if isinstance(prompt, list) else len(prompt) // 4 + 1
    return num_prompt + (n or 1) * (max_tokens or ENGINE_MAX_TOKENS)


def _tool_choice(request: ChatRequest | CompletionRequest) -> str | None:
    """The request's normalized tool choice (``sdk.tools.to_tool_choice``); None without tools."""
    if not isinstance(request, ChatRequest):
        return None
    return to_tool_choice(request.tool_choice, request.tools)


async def _next(stream: AsyncIterator[Delta], deadline: float | None) -> Delta | None:
    """The next delta, or None at the end; raises TimeoutError past ``deadline``."""
    try:
        if deadline is None:
            return await anext(stream)
        return await asyncio.wait_for(anext(stream), max(deadline - time.monotonic(), 0.0))
    except StopAsyncIteration:
        return None


async def _nothing() -> AsyncIterator[Delta]:
    return
    yield


async def _prepend(first: Delta | None, stream: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    try:
        if first is not None:
            yield first
            async for delta in stream:
                yield delta
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
