"""AsyncClient: chat, complete, stream, batch and shared prefixes, with the hooks run on every request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, TypeVar, Union

from pydantic import ValidationError

from sdk.closing import AsyncClosing
from sdk.cut_off import CutOffWatch
from sdk.errors import EngineFailure, InvalidRequestError, from_wire
from sdk.fields import invalid_request
from sdk.hooks import HookChain, RequestOrigin
from sdk.hooks.base import RequestKind
from sdk.pooling_run import run_pooling
from sdk.policy import engine_salt
from sdk.prefix import PinnedPrefixes, PrefixHandle
from sdk.rate_limit import RateLimiter
from sdk.reattach import fetch_result
from sdk.request_run import RequestRun, RequestScope, Startup
from sdk.response_format import parse
from sdk.retrieval import (
    EmbedInputLike, Embedding, EmbeddingResult, RerankResult, ScoreResult, check_top_n, embed_inputs, pooling_params, ranked,
    score_inputs, usage,
)
from sdk.responses.service import Responder
from sdk.responses.types import TERMINAL_EVENTS, ResponseRequest
from sdk.runtime import Runtime
from sdk.settings import ClientSettings
from sdk.tools import collect_calls
from sdk.transport import InProcessTransport, Pooled, Transport
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


def _close_remote(transport: Transport, runtime: Runtime) -> None:
    """Close a remote client's connections when it is collected or the interpreter exits."""
    if runtime.closed:
        return  # closed by aclose(), the transport with it
    try:
        runtime.run_sync(transport.close())
    except RuntimeError:  # collected on the runtime's own loop thread, which cannot wait on itself
        runtime.submit(transport.close())


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
        model: HF directory or ``.gguf`` path; None = the bundled SmolLM2-135M-Instruct
            (``ClientSettings.model``).
        settings: the client's settings whole, instead of ``model`` and keywords.
        **keywords: ``ClientSettings`` fields (``runtime``, ``base_url``, ``api_key``, ``hooks``,
            ``tenant``, ``policy``, ``transport``, ``route``, ``max_retries``, ``reasoning_parser``,
            ``image_limits``); the rest are ``engine.EngineConfig`` fields for the in-process engine.

    Raises:
        ValueError: ``settings`` with ``model`` or keywords, or settings that contradict each
            other (``ClientSettings``).
        InvalidRequestError: an unknown ``reasoning_parser``.
    """

    def __init__(self, model: str | None = None, *, settings: ClientSettings | None = None, **keywords: Any) -> None:
        self.settings = settings = ClientSettings.of(model, settings, **keywords)
        """What the client was given (``ClientSettings``)."""
        self._owns_transport = settings.transport is None
        self._owns_runtime = settings.runtime is None
        self.transport, self.runtime = _make_transport(settings)
        """Where the client's requests run, and the runtime its in-process engine belongs to (whose loop sync callers use)."""
        self.hooks = HookChain(settings.hooks)
        self.limiter = RateLimiter(settings.policy) if settings.policy is not None and settings.policy.has_limits else None
        """The tenant's rate state (``sdk.rate_limit``); None without limits."""
        self._prefixes = PinnedPrefixes()
        self._responder = Responder()  # NOTE: in process: this client's stored responses and conversation pins
        self._startup = Startup(self.transport)
        self._scope = RequestScope(
            self.transport, self.hooks, settings.tenant, settings.policy, self.limiter, settings.route,
            settings.max_retries, self._prefixes, self._startup,
        )  # fmt: skip
        if self._owns_transport and settings.base_url is not None:
            # NOTE: also at interpreter exit, before the runtime (made earlier) stops the loop its sessions live on
            weakref.finalize(self, _close_remote, self.transport, self.runtime)

    async def start(self) -> None:
        """Load the engine (or connect to ``base_url``) now, so the first request does not wait for it.

        The warm-up: without it the first request (or ``prefix()``) loads the engine. Idempotent.
        """
        await self._startup()

    @property
    def model_name(self) -> str:
        """The served model's name (after ``start()``)."""
        return self.transport.model_name

    @property
    def max_model_len(self) -> int:
        """Longest prompt + completion in tokens (after ``start()``)."""
        return self.transport.max_model_len

    def stats(self) -> dict[str, Any]:
        """The engine's figures (``engine.AsyncEngine.stats()`` keys) plus ``hook_failures``.

        Raises:
            RuntimeError: before ``start()`` (or a first request).
        """
        if not self._startup.is_started:
            raise RuntimeError("client not started: await start() or make a request first")
        return {**self.transport.stats(), "hook_failures": self.hooks.num_failures}

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
        origin: RequestOrigin | None = None, resume_token_ids: list[int] | None = None, **options: Any,
    ) -> AsyncIterator[Delta]:  # fmt: skip
        """Stream a chat reply (``messages``) or a raw completion (``prompt=``) as deltas.

        The last delta has ``finish_reason`` and ``usage``. Leaving the loop early aborts the
        request once the iterator is closed (``contextlib.aclosing`` makes that immediate).
        Options and errors as ``chat``; an output filter that stops the stream ends it with
        ``finish_reason="content_filter"`` (not an error). ``resume_token_ids`` (in process, ``n == 1``)
        continues a run whose caller already got those output tokens: the deltas carry only what follows
        (a server replaying its journal uses it).
        """
        if (messages is None) == (prompt is None):
            raise ValueError("give messages (chat) or prompt= (completion), not both")
        if messages is not None:
            return self._run(self._chat_request(messages, options), origin, resume_token_ids)
        return self._run(self._completion_request(prompt, options), origin, resume_token_ids)  # type: ignore[arg-type]

    async def retrieve(self, request_id: str) -> CompletionResult:
        """Re-attach to a request a server journalled as it shut down: its whole result, once finished.

        A stream cut by a ``paged serve --drain-journal`` shutdown raises ``RequestJournalled``
        (``request_id`` is the server's id); a server restarted on the same ``kv_cache_dir`` finishes
        the request, and this fetches it (``GET /v1/chat/completions/{id}``; the server waits while it runs).
        The result's text is the whole reply, the part the stream already gave included.

        With ``max_retries`` a stream does this itself: its last delta is then the rest of the
        result, and the stream goes on as if never cut. Here as there, a server still down or starting is
        waited for up to ``max_retries`` times (from 1 s, doubling).

        Returns:
            A ``ChatResult`` for a chat request, a ``CompletionResult`` for a completion.

        Raises:
            NotFoundError: the server has no such request (in process: never one).
            EngineRestarting: the server was still down or starting at the last try.
            PagedError: as ``chat``, for the replay's own failure.
        """
        await self.start()
        return await fetch_result(self.transport, request_id, self.settings.max_retries)

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

    async def respond(
        self, input: Any = None, *, stream: bool = False, origin: RequestOrigin | None = None, **fields: Any
    ) -> Any:
        """Run a Responses API request: OpenAI's ``responses.create`` on this client's engine.

        In process, the client keeps its stored responses (in memory) and pins their
        conversations, so ``previous_response_id`` continues one; with ``base_url`` the server does.

        Args:
            input: a user message's text, a list of input items, or a ``ResponseRequest`` (then no ``fields``).
            stream: return the stream events (``ResponseEvent``, from ``response.created`` to
                ``response.completed`` / ``incomplete`` / ``failed``) instead of the response.
            origin: who sent it (client address, headers), for the hooks' context.
            **fields: ``ResponseRequest`` fields: ``instructions``, ``tools``, ``tool_choice``,
                ``text``, ``previous_response_id``, ``max_output_tokens``, ``temperature`` ...

        Returns:
            The ``Response`` (``output``, ``output_text``, ``status``, ``usage``), or with ``stream``
            an async iterator of its events (closing it early aborts the reply).

        Raises:
            InvalidRequestError: a field the request cannot have (``param`` names it: ``input.2.call_id``).
            NotFoundError: ``previous_response_id`` is no stored response of this client's tenant.
            PagedError: as ``chat``, and after the start (not streamed) what failed the reply.
        """
        try:
            if isinstance(input, ResponseRequest):
                request = ResponseRequest.model_validate({**input.model_dump(exclude_unset=True), **fields}) if fields else input
            else:
                request = ResponseRequest(input=input, **fields)
        except ValidationError as exc:
            raise invalid_request(exc) from None
        await self.start()
        events = await self.transport.respond(request)
        if events is None:
            events = await self._responder.open(self, request, origin=origin, stream=stream)
        if stream:
            return events
        response = None
        async with contextlib.aclosing(events):
            async for event in events:
                if event.type in TERMINAL_EVENTS:
                    response = event.response
        if response is None:
            raise EngineFailure("the response ended without its last event")
        if response.status == "failed" and response.error is not None:  # a remote server's failure
            raise from_wire(500, response.error.model_dump())
        return response

    async def embed(self, input: EmbedInputLike, *, origin: RequestOrigin | None = None, **options: Any) -> EmbeddingResult:
        """Embed one text (or token-id list) or several; the engine batches them under its token budget.

        The client's hooks run on the request as on ``chat`` (kind ``"embed"``): input filters read each
        input, and the audit record counts the inputs and the tokens read.

        Args:
            input: a text, a list of token ids, or a list of either (at most ``MAX_INPUTS``).
            origin: who sent it (client address, headers), for the hooks' context.
            **options: ``engine.PoolingParams`` fields: ``dimensions`` (Matryoshka models),
                ``normalize``, ``truncate_prompt_tokens`` (-1: the model's length, the default; None: off),
                ``prompt_name`` (a prompt prefix of the model's, such as ``"query"``).

        Returns:
            One embedding per input, in order, and the tokens read.

        Raises:
            ContentBlocked: an input filter blocked an input (``param``: ``input.i``).
            HookFailed: a filter hook raised (fail closed).
            InvalidRequestError: no input, an empty one, too many, bad options, an input over the model's
                length with truncation off, or a model that does not embed (``param`` names the field).
            RateLimited: the policy's rate or concurrency limit is spent.
            OverloadedError, EngineRestarting, EngineFailure: as ``chat``.
        """
        inputs = embed_inputs(input)
        params = pooling_params(options)
        pooled = await run_pooling(
            self._scope, "embed", inputs, params, lambda items, _: self.transport.embed(items, params), origin=origin
        )
        data = [Embedding(index=i, embedding=v) for i, v in enumerate(pooled.values)]
        return EmbeddingResult(model=pooled.model or self.model_name, data=data, usage=usage(pooled.num_tokens))

    async def score(
        self, query: str | Sequence[str], documents: str | Sequence[str], *, origin: RequestOrigin | None = None,
        **options: Any,
    ) -> ScoreResult:  # fmt: skip
        """Each document's relevance to ``query``, in document order: a cross-encoder's score (sigmoid of its
        logit; ``use_activation=False``: the logit), or an embedding model's cosine. A list of queries, one
        per document, scores pairs (vLLM's ``text_1`` list). Hooks as ``embed`` (kind ``"score"``; a filter's
        block names ``query``, ``query.i`` or ``documents.i``).

        Raises:
            InvalidRequestError: an empty query or document, queries not one per document, more than
                ``MAX_DOCUMENTS``, bad options, a pair over the model's length with truncation off, or a
                generative model. Others as ``embed``.
        """
        return await self._score("score", query, documents, origin, options)

    async def rerank(
        self, query: str, documents: Sequence[str], *, top_n: int | None = None, return_documents: bool = True,
        origin: RequestOrigin | None = None, **options: Any,
    ) -> RerankResult:  # fmt: skip
        """The documents by relevance to ``query``, highest first: ``score`` sorted, the first ``top_n``.
        Hooks as ``score`` (kind ``"rerank"``).

        Raises:
            InvalidRequestError: ``top_n`` below 1, or as ``score``.
        """
        check_top_n(top_n)
        if not isinstance(query, str):
            raise InvalidRequestError.about("query", "must be a non-empty string")
        scored = await self._score("rerank", query, documents, origin, options)
        results = ranked(scored.scores, list(documents), top_n, return_documents)
        return RerankResult(model=scored.model, results=results, usage=scored.usage)

    async def _score(
        self, kind: RequestKind, query: str | Sequence[str], documents: str | Sequence[str],
        origin: RequestOrigin | None, options: dict[str, Any],
    ) -> ScoreResult:  # fmt: skip
        checked, docs = score_inputs(query, documents)
        params = pooling_params(options)

        async def call(items: list[Any], hooked: str | list[str] | None) -> Pooled:
            assert hooked is not None  # NOTE: a filter may rewrite the query, never remove it
            return await self.transport.score(hooked, items, params)

        pooled = await run_pooling(self._scope, kind, docs, params, call, query=checked, origin=origin)
        return ScoreResult(model=pooled.model or self.model_name, scores=pooled.values, usage=usage(pooled.num_tokens))

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
        token_ids = self.transport.render_chat(messages, add_generation_prompt=False)
        salt = engine_salt(self.settings.policy, self.settings.tenant, cache_salt)
        handle = PrefixHandle(await self.transport.pin_prefix(token_ids, salt), messages, self.transport, self.runtime)
        self._prefixes.add(handle)
        return handle

    async def aclose(self) -> None:
        """Unpin this client's open prefixes, close its connections, and close its own runtime.

        A remote client's connections are also closed when it is collected or at interpreter
        exit; close it (or use ``async with``) on an event loop of your own, which may be gone by then.

        A ``runtime`` given to the client stays open (with its engine) for other clients, and
        the client stays usable; on its own runtime, in-process calls raise RuntimeError afterwards.
        """
        await self._prefixes.aclose()
        await self._responder.aclose()
        if self._owns_transport:
            await self.transport.close()
        if self._owns_runtime:
            await self.runtime.aclose()  # NOTE: last: a sync client's close() runs on this runtime's loop

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

    def _run(
        self, request: ChatRequest | CompletionRequest, origin: RequestOrigin | None, resume_token_ids: list[int] | None = None
    ) -> AsyncIterator[Delta]:  # fmt: skip
        return RequestRun(self._scope, request, origin, resume_token_ids).deltas()


def _with_options(request: RequestT, options: dict[str, Any]) -> RequestT:
    """``request`` with ``options`` set, validated as a new request would be."""
    if not options:
        return request
    return type(request).model_validate({**request.model_dump(exclude_unset=True), **options})


def _make_transport(settings: ClientSettings) -> tuple[Transport, Runtime]:
    """Where requests run, and the runtime they belong to.

    The transport is ``settings.transport`` as given, else the engine of ``settings.runtime``,
    else ``base_url``'s endpoint, else the engine of a new runtime for (model, engine_config).
    A remote client gets an empty runtime: it never loads an engine, it lends sync callers its loop.
    """
    if settings.transport is not None:
        return settings.transport, Runtime()
    runtime = settings.runtime
    if runtime is None and settings.base_url is not None:
        from sdk.http_transport import HttpTransport  # NOTE: aiohttp loads only for remote clients

        return HttpTransport(settings.base_url, api_key=settings.api_key, model=settings.model), Runtime()
    if runtime is None:
        runtime = Runtime(settings.model, **settings.engine_config)
    # NOTE: with a runtime given, model names one of its chat models; a runtime of the client's own holds that one
    model = settings.model if settings.runtime is not None else None
    return InProcessTransport(runtime, settings.reasoning_parser, settings.image_limits, model), runtime
