"""AsyncClient: chat, complete, stream, batch and shared prefixes, with the hooks run on every request."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, TypeVar, Union

from pydantic import ValidationError

from sdk.closing import AsyncClosing, Closing
from sdk.cut_off import CutOffWatch
from sdk.errors import InvalidRequestError
from sdk.fields import invalid_request
from sdk.hooks import Hook, HookChain, ModelSource, RequestOrigin
from sdk.hooks.replay import model_source
from sdk.images import ImageLimits
from sdk.policy import TenantPolicy, engine_salt
from sdk.rate_limit import RateLimiter
from sdk.reasoning import check_parser_name
from sdk.request_run import RequestRun
from sdk.response_format import parse
from sdk.runtime import Runtime
from sdk.tools import collect_calls
from sdk.transport import InProcessTransport, PrefixPin, Transport
from sdk.types import (
    ChatMessage,
    ChatRequest,
    ChatResult,
    Choice,
    CompletionRequest,
    CompletionResult,
    Delta,
)

logger = logging.getLogger(__name__)

MessagesLike = Union[str, ChatRequest, Sequence[Union[ChatMessage, dict[str, Any], tuple[str, str]]]]
PromptLike = Union[str, list[int], CompletionRequest]
RequestT = TypeVar("RequestT", ChatRequest, CompletionRequest)
ResultT = TypeVar("ResultT", ChatResult, CompletionResult)



def to_messages(messages: str | Sequence[ChatMessage | dict[str, Any] | tuple[str, str]]) -> list[ChatMessage]:
    """A conversation from a user string, ``ChatMessage``s, ``{"role", "content"}`` dicts or (role, content) pairs."""
    if isinstance(messages, str):
        return [ChatMessage(role="user", content=messages)]
    out = []
    for m in messages:
        if isinstance(m, ChatMessage):
            out.append(m)
        elif isinstance(m, dict):
            out.append(ChatMessage(**m))
        else:
            role, content = m
            out.append(ChatMessage(role=role, content=content))  # type: ignore[arg-type]
    return out


class PrefixHandle(Closing, AsyncClosing):
    """A shared prefix whose KV blocks stay pinned in the engine while the handle is open.

    Requests whose prompt starts with the prefix's tokens (for a chat prefix: a conversation
    that starts with ``messages``) skip its prefill; ``num_hit_tokens`` counts the tokens they
    were served from the cache. Close it with ``aclose()`` / ``close()`` or a ``with`` block;
    a handle that is garbage-collected unpins too.
    """

    def __init__(self, client: AsyncClient, pin: PrefixPin, messages: list[ChatMessage] | None) -> None:
        self._client = client
        self.pin_id = pin.pin_id
        self.token_ids = pin.token_ids
        self.messages = messages
        """The prefix conversation (chat prefixes); start requests with ``[*handle.messages, ...]``."""
        self.num_cached_at_pin = pin.num_cached_tokens
        self.num_requests = 0
        """Requests that started with this prefix."""
        self.num_hit_tokens = 0
        """Prompt tokens of those requests served from the cache, up to the prefix's length."""
        self.closed = False
        self._finalizer = weakref.finalize(self, _unpin_later, client.runtime, client._transport, pin.pin_id)
        self._finalizer.atexit = False  # the runtimes shut their engines down at exit anyway

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def matches(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether a prompt starts with this prefix."""
        n = len(self.token_ids)
        return len(prompt_token_ids) >= n and list(prompt_token_ids[:n]) == self.token_ids

    async def aclose(self) -> None:
        """Unpin the prefix; its blocks stay cached (evictable). Idempotent."""
        if not self.closed:
            self.closed = True
            self._finalizer.detach()
            await self._client._transport.unpin_prefix(self.pin_id)

    def close(self) -> None:
        """Sync ``aclose()`` (runs on the client's runtime loop thread); not for use inside a running event loop."""
        self._client.runtime.run_sync(self.aclose())

    def __repr__(self) -> str:
        return (
            f"PrefixHandle(num_tokens={self.num_tokens}, num_requests={self.num_requests}, "
            f"num_hit_tokens={self.num_hit_tokens}, closed={self.closed})"
        )


def _close_remote(transport: Transport, runtime: Runtime) -> None:
    """Close a remote client's connections when it is collected or the interpreter exits."""
    if runtime.closed:
        return  # closed by aclose(), the transport with it
    try:
        runtime.run_sync(transport.close())
    except RuntimeError:  # collected on the runtime's own loop thread, which cannot wait on itself
        runtime.submit(transport.close())


def _unpin_later(runtime: Runtime, transport: Transport, pin_id: str) -> None:
    if not runtime.closed:  # a closed runtime's own engine is shut down, its pins with it
        runtime.submit(transport.unpin_prefix(pin_id))


class AsyncClient(AsyncClosing):
    """The async SDK client; an in-process engine by default, or a remote one with ``base_url``.

    In-process, the client runs on the engine of ``runtime`` (shared, left open by
    ``aclose()``), or of a ``Runtime`` of its own that ``aclose()`` closes.

    Example:
        client = AsyncClient(hooks=[AuditLog("audit.jsonl")])
        remote = AsyncClient(base_url="http://gpu-box:8000/v1", api_key=KEY)  # same API
        runtime = Runtime()
        a, b = AsyncClient(runtime=runtime), AsyncClient(runtime=runtime)  # one engine
        async with await client.prefix(SYSTEM) as system:
            result = await client.chat([*system.messages, ChatMessage(role="user", content="Hi")])

    Args:
        model: HF directory or ``.gguf`` path; None = the bundled SmolLM2-135M-Instruct.
            With ``base_url``: the remote model id; None = the first one the endpoint lists.
        runtime: share this runtime's engine (loaded on first use) instead of loading one.
        base_url: an OpenAI-compatible endpoint (``paged serve``, vLLM ...) to run requests
            on, through ``sdk.http_transport.HttpTransport``; None = in-process.
        api_key: sent to ``base_url`` as a bearer token.
        hooks: run in order on every request (see ``sdk.hooks``).
        tenant: written to each request's context and audit record, and the engine's fair
            share: within a priority, tenants share the token budget by their policy's weight.
        policy: the tenant's priority cap, weight, ``max_tokens`` cap, rate limits and cache
            isolation (``sdk.policy.TenantPolicy``), enforced on every request; None = none
            (priorities as asked, weight 1).
        transport: where requests run; default: ``base_url``'s endpoint, or the engine of
            ``runtime`` or of the client's own runtime for (model, engine_config).
        route: names the surface in hook contexts and audit records (adapters set theirs).
        max_retries: times to retry a request the engine refused as overloaded, or lost to a restart
            before its first output (with backoff).
        reasoning_parser: how a thinking model's reasoning is split from its replies' text
            (``sdk.reasoning``): ``"auto"`` (from the chat template), ``"none"``, ``"qwen3"`` or
            ``"deepseek_r1"``. In-process only: a remote server parses with its own.
        image_limits: what a request's images may be (``sdk.images.ImageLimits``: count, bytes,
            pixels, remote hosts); None = its defaults. In-process only: a remote server has its own.
        **engine_config: ``engine.EngineConfig`` fields for the in-process engine.

    Raises:
        ValueError: ``runtime`` or ``transport`` with any of model/base_url/api_key/engine_config
            (or each other), ``base_url`` with engine_config, ``api_key`` without ``base_url``,
            ``reasoning_parser`` or ``image_limits`` with ``base_url`` or ``transport``, or a policy that isolates
            the cache without a ``tenant``.
        InvalidRequestError: an unknown ``reasoning_parser``.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        runtime: Runtime | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        hooks: Sequence[Hook] = (),
        tenant: str | None = None,
        policy: TenantPolicy | None = None,
        transport: Transport | None = None,
        route: str = "client",
        max_retries: int = 0,
        reasoning_parser: str = "auto",
        image_limits: ImageLimits | None = None,
        **engine_config: Any,
    ) -> None:
        if policy is not None and policy.isolate_cache and tenant is None:
            raise ValueError("a policy with isolate_cache needs a tenant: the salt is the tenant's")
        self._owns_transport = transport is None
        self._owns_runtime = runtime is None
        self._transport, self._runtime = _make_transport(
            transport, runtime, model, base_url, api_key, engine_config, check_parser_name(reasoning_parser), image_limits
        )
        self.hooks = HookChain(hooks)
        self.tenant = tenant
        self.policy = policy
        self.limiter = RateLimiter(policy) if policy is not None and policy.has_limits else None
        """The tenant's rate state (``sdk.rate_limit``); None without limits."""
        self.route = route
        self.max_retries = max_retries
        self._prefixes: weakref.WeakSet[PrefixHandle] = weakref.WeakSet()
        self._model_source: ModelSource | None = None
        self._started = False
        if self._owns_transport and base_url is not None:
            # NOTE: also at interpreter exit, before the runtime (made earlier) stops the loop its sessions live on
            weakref.finalize(self, _close_remote, self._transport, self._runtime)

    async def start(self) -> None:
        """Load the engine (or connect to ``base_url``) now, so the first request does not wait for it.

        The warm-up: without it the first request (or ``prefix()``) loads the engine. Idempotent.
        """
        if not self._started:
            await self._transport.start()
            self._model_source = model_source(self._transport)
            self._started = True

    @property
    def runtime(self) -> Runtime:
        """The runtime the client's in-process engine belongs to, and whose loop sync callers use."""
        return self._runtime

    @property
    def transport(self) -> Transport:
        """Where this client's requests run."""
        return self._transport

    @property
    def model_name(self) -> str:
        """The served model's name (after ``start()``)."""
        return self._transport.model_name

    @property
    def max_model_len(self) -> int:
        """Longest prompt + completion in tokens (after ``start()``)."""
        return self._transport.max_model_len

    def stats(self) -> dict[str, Any]:
        """The engine's figures (``engine.AsyncEngine.stats()`` keys) plus ``hook_failures``.

        Raises:
            RuntimeError: before ``start()`` (or a first request).
        """
        if not self._started:
            raise RuntimeError("client not started: await start() or make a request first")
        return {**self._transport.stats(), "hook_failures": self.hooks.num_failures}

    async def chat(self, messages: MessagesLike, *, origin: RequestOrigin | None = None, **options: Any) -> ChatResult:
        """Generate a reply to a conversation.

        Args:
            messages: a user string, a list of messages (``ChatMessage``, dicts or (role,
                content) pairs) or a ``ChatRequest``.
            origin: who sent it (client address, headers), for the hooks' context.
            **options: ``ChatRequest`` fields: sampling knobs (``max_tokens``, ``temperature``,
                ``stop`` ...), ``request_id``, ``priority``, ``cache_salt``, ``timeout``.

        Returns:
            The reply with its finish reason and usage.

        Raises:
            ContentBlocked: an input filter blocked the request.
            HookFailed: a filter hook raised (fail closed).
            InvalidRequestError: bad options, a priority or ``max_tokens`` past the policy's cap,
                or a prompt the engine cannot serve (too long: refused by its characters
                before it is rendered or tokenized).
            RateLimited: the policy's rate or concurrency limit is spent (``retry_after``).
            OverloadedError: the engine's queue stayed full through the retries.
            RequestTimeout: ``timeout`` passed; the request was aborted.
            EngineFailure: the engine failed.
        """
        return await self._collect(self._chat_request(messages, options), ChatResult, origin)

    async def complete(self, prompt: PromptLike, *, origin: RequestOrigin | None = None, **options: Any) -> CompletionResult:
        """Continue a raw prompt (text or token ids; no chat template). Options and errors as ``chat``."""
        return await self._collect(self._completion_request(prompt, options), CompletionResult, origin)

    def stream(
        self, messages: MessagesLike | None = None, *, prompt: PromptLike | None = None,
        origin: RequestOrigin | None = None, **options: Any,
    ) -> AsyncIterator[Delta]:  # fmt: skip
        """Stream a chat reply (``messages``) or a raw completion (``prompt=``) as deltas.

        The last delta has ``finish_reason`` and ``usage``. Leaving the loop early aborts the
        request once the iterator is closed (``contextlib.aclosing`` makes that immediate).
        Options and errors as ``chat``; an output filter that stops the stream ends it with
        ``finish_reason="content_filter"`` (not an error).
        """
        if (messages is None) == (prompt is None):
            raise ValueError("give messages (chat) or prompt= (completion), not both")
        if messages is not None:
            return self._run(self._chat_request(messages, options), origin)
        return self._run(self._completion_request(prompt, options), origin)  # type: ignore[arg-type]

    async def batch(
        self, requests: Iterable[MessagesLike], *, return_exceptions: bool = False, **options: Any
    ) -> list[Any]:
        """Run many chat requests concurrently (the engine batches them); results in order.

        Args:
            requests: conversations, as ``chat`` takes them.
            return_exceptions: put errors in the list instead of raising the first.
            **options: applied to every request.
        """
        coros = [self.chat(r, **options) for r in requests]
        return list(await asyncio.gather(*coros, return_exceptions=return_exceptions))

    async def prefix(
        self, prefix: str | Sequence[ChatMessage | dict[str, Any] | tuple[str, str]], *, cache_salt: str | None = None
    ) -> PrefixHandle:
        """Warm and pin a shared prefix: a system prompt (a string) or the first messages of conversations.

        Args:
            prefix: a system prompt, or a list of messages every conversation will start with.
            cache_salt: pin it in this cache namespace (requests must use the same salt to hit it).

        Returns:
            An open ``PrefixHandle``; close it to unpin.
        """
        await self.start()
        messages = [ChatMessage(role="system", content=prefix)] if isinstance(prefix, str) else to_messages(prefix)
        images = [f"{i}.content.{j}" for i, m in enumerate(messages) for j, _ in m.image_parts]
        if images:
            raise InvalidRequestError.about(f"prefix.{images[0]}", "a pinned prefix is text only")
        token_ids = self._transport.render_chat(messages, add_generation_prompt=False)
        salt = engine_salt(self.policy, self.tenant, cache_salt)
        handle = PrefixHandle(self, await self._transport.pin_prefix(token_ids, salt), messages)
        self._prefixes.add(handle)
        return handle

    async def aclose(self) -> None:
        """Unpin this client's open prefixes, close its connections, and close its own runtime.

        A remote client's connections are also closed when it is collected or at interpreter
        exit; close it (or use ``async with``) on an event loop of your own, which may be gone by then.

        A ``runtime`` given to the client stays open (with its engine) for other clients, and
        the client stays usable; on its own runtime, in-process calls raise RuntimeError afterwards.
        """
        for handle in list(self._prefixes):
            await handle.aclose()
        if self._owns_transport:
            await self._transport.close()
        if self._owns_runtime:
            await self._runtime.aclose()  # NOTE: last: a sync client's close() runs on this runtime's loop

    # --- the request path ----------------------------------------------------------------

    def _chat_request(self, messages: MessagesLike, options: dict[str, Any]) -> ChatRequest:
        try:
            if isinstance(messages, ChatRequest):
                return _with_options(messages, options)
            return ChatRequest(messages=to_messages(messages), **options)
        except ValidationError as exc:
            raise invalid_request(exc) from None

    def _completion_request(self, prompt: PromptLike, options: dict[str, Any]) -> CompletionRequest:
        try:
            if isinstance(prompt, CompletionRequest):
                return _with_options(prompt, options)
            return CompletionRequest(prompt=prompt, **options)
        except ValidationError as exc:
            raise invalid_request(exc) from None

    async def _collect(
        self, request: ChatRequest | CompletionRequest, result_type: type[ResultT], origin: RequestOrigin | None
    ) -> ResultT:
        want_logprobs = request.logprobs is not None
        choices: dict[int, dict[str, Any]] = {}
        watch = CutOffWatch.of(request)
        last: Delta | None = None
        async for last in self._run(request, origin):
            choice = choices.setdefault(last.index, {"text": [], "reasoning": [], "token_ids": [], "logprobs": [], "tool_calls": []})
            choice["text"].append(last.text)
            choice["reasoning"].append(last.reasoning)
            choice["token_ids"].extend(last.token_ids)
            choice["logprobs"].extend(last.logprobs or ())
            choice["tool_calls"].extend(last.tool_calls or ())
            if last.finish_reason is not None:
                choice["finish_reason"] = last.finish_reason
            choice["cut_off"] = watch.add(last) is not None or choice.get("cut_off", False)
        assert last is not None and last.usage is not None
        return result_type(
            request_id=last.request_id,
            model=self.model_name,
            choices=[
                Choice(
                    index=index,
                    text="".join(c["text"]),
                    reasoning="".join(c["reasoning"]) or None,
                    token_ids=c["token_ids"],
                    # NOTE: a content filter that stops the stream ends every completion
                    finish_reason=c.get("finish_reason", last.finish_reason),
                    logprobs=c["logprobs"] if want_logprobs else None,
                    parsed=parse(request.response_format, "".join(c["text"])) if c.get("finish_reason") == "stop" else None,
                    tool_calls=collect_calls(c["tool_calls"]) or None,
                    cut_off=c["cut_off"],
                )
                for index, c in sorted(choices.items())
            ],
            usage=last.usage,
        )

    def _run(self, request: ChatRequest | CompletionRequest, origin: RequestOrigin | None) -> AsyncIterator[Delta]:
        return RequestRun(self, request, origin).deltas()

    def _count_prefix_hits(self, prompt_token_ids: Sequence[int], num_cached_tokens: int) -> None:
        for handle in list(self._prefixes):
            if not handle.closed and handle.matches(prompt_token_ids):
                handle.num_requests += 1
                handle.num_hit_tokens += min(num_cached_tokens, handle.num_tokens)


def _with_options(request: RequestT, options: dict[str, Any]) -> RequestT:
    """``request`` with ``options`` set, validated as a new request would be."""
    if not options:
        return request
    return type(request).model_validate({**request.model_dump(exclude_unset=True), **options})


def _make_transport(
    transport: Transport | None,
    runtime: Runtime | None,
    model: str | None,
    base_url: str | None,
    api_key: str | None,
    engine_config: dict[str, Any],
    reasoning_parser: str,
    image_limits: ImageLimits | None = None,
) -> tuple[Transport, Runtime]:
    """Where requests run, and the runtime they belong to.

    The transport is ``transport`` as given, else ``runtime``'s engine, else ``base_url``'s
    endpoint, else the engine of a new runtime for (model, engine_config). A remote client
    gets an empty runtime: it never loads an engine, it lends sync callers its loop.

    Raises:
        ValueError: settings that contradict each other; the message names them.
    """
    named = {"model": model, "base_url": base_url, "api_key": api_key}
    if runtime is not None:
        _refuse("runtime", {**named, "transport": transport}, engine_config, "the runtime's engine serves the requests")
        return InProcessTransport(runtime, reasoning_parser, image_limits), runtime
    where = "transport" if transport is not None else "base_url"
    if reasoning_parser != "auto" and (transport is not None or base_url is not None):
        raise ValueError(f"reasoning_parser and {where} both given: the {where} parses replies with its own")
    if image_limits is not None and (transport is not None or base_url is not None):
        raise ValueError(f"image_limits and {where} both given: the {where} checks images with its own")
    if transport is not None:
        _refuse("transport", named, engine_config, "the transport fixes where requests run")
        return transport, Runtime()
    if base_url is None:
        if api_key is not None:
            raise ValueError("api_key given without base_url: the in-process engine takes no key")
        runtime = Runtime(model, **engine_config)
        return InProcessTransport(runtime, reasoning_parser, image_limits), runtime
    if engine_config:
        fields = ", ".join(sorted(engine_config))
        raise ValueError(f"base_url and engine fields ({fields}) both given: a remote engine is set up by its server")
    from sdk.http_transport import HttpTransport  # NOTE: aiohttp loads only for remote clients

    return HttpTransport(base_url, api_key=api_key, model=model), Runtime()


def _refuse(setting: str, named: dict[str, Any], engine_config: dict[str, Any], reason: str) -> None:
    """Raise ValueError naming the settings given along with ``setting`` (set ``named`` values, engine_config keys)."""
    given = [name for name, value in named.items() if value is not None] + sorted(engine_config)
    if given:
        raise ValueError(f"{setting} and {', '.join(given)} both given: {reason}")
