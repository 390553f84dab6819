"""A ``Transport`` over any OpenAI-compatible HTTP endpoint (``paged serve``, or a vLLM fleet).

Chat requests go to ``/v1/chat/completions`` with the messages (the server applies its own
chat template); raw prompts go to ``/v1/completions``. Both stream (SSE) and ask for
``return_token_ids`` (a vLLM extension ``paged serve`` also speaks), so token ids, usage
and logprobs (either OpenAI format) match what the in-process transport reports. Closing
the output iterator closes the HTTP response, which the server turns into an abort of the
engine request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp

from engine.pooling.params import PoolingParams

from sdk.errors import ContentBlocked, EngineFailure, EngineRestarting, InvalidRequestError, from_wire
from sdk.images import ImageInfo, data_url_infos
from sdk.responses.types import ResponseEvent
from sdk.transport import EngineRequest, Pooled, PrefixPin, Transport
from sdk.types import (
    ChatMessage, ChatResult, Choice, CompletionResult, Delta, RequestLatency, SamplingOptions, TokenLogprob, TopLogprob,
    Usage,
)  # fmt: skip
from sdk.tools import ToolSpec
from sdk.wire import Route, format_to_wire, message_to_wire, to_wire, tool_call_delta_from_wire

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 1 << 20  # when the endpoint does not say


class ChatPrompt(str):
    """A rendered chat prompt that remembers its messages, so the server applies the template.

    ``render_chat`` returns it in place of token ids: its text is a plain transcript (for
    logs and lengths); ``generate`` sends ``messages`` to ``/v1/chat/completions``.
    """

    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool

    def __new__(cls, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> ChatPrompt:
        prompt = super().__new__(cls, "\n".join(f"{m.role}: {m.text}" for m in messages))
        prompt.messages = tuple(messages)
        prompt.add_generation_prompt = add_generation_prompt
        return prompt


class HttpTransport(Transport):
    """Runs requests on a remote OpenAI-compatible server.

    Args:
        base_url: the server's root, with or without the ``/v1`` suffix.
        api_key: sent as ``Authorization: Bearer``; None sends none.
        model: the model id to request; None takes the first one ``/v1/models`` lists.
        timeout: seconds to connect; a request itself is bounded by the SDK's per-request timeout.
        session: an ``aiohttp.ClientSession`` to use (it must live on the caller's loop);
            by default one is made per event loop and closed by ``close()``.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        model: str | None = None,
        *,
        timeout: float = 30.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        root = base_url.rstrip("/")
        self._base = root if root.endswith("/v1") else root + "/v1"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._model = model
        self._max_model_len: int | None = None
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout)
        self._session = session
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._open: dict[str, aiohttp.ClientResponse] = {}

    @property
    def model_name(self) -> str:
        if self._model is None:
            raise RuntimeError("transport not started: await start() first")
        return self._model

    @property
    def max_model_len(self) -> int:
        return self._max_model_len or DEFAULT_MAX_MODEL_LEN

    def _client(self) -> aiohttp.ClientSession:
        if self._session is not None:
            return self._session
        # NOTE: a session belongs to one event loop; the sync client runs on a loop of its own.
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
            self._sessions[loop] = session
        return session

    async def start(self) -> None:
        if self._model is not None and self._max_model_len is not None:
            return
        async with self._client().get(self._base + "/models", headers=self._headers) as resp:
            body = await _json_or_raise(resp)
        cards = body.get("data") or []
        if self._model is None:
            if not cards:
                raise EngineFailure(f"{self._base}/models lists no model")
            self._model = cards[0]["id"]
        for card in cards:
            if card.get("id") == self._model and card.get("max_model_len"):
                self._max_model_len = int(card["max_model_len"])

    async def close(self) -> None:
        """Close the sessions this transport opened, each on its own loop; a later request opens a new one."""
        sessions, self._sessions = self._sessions, {}
        current = asyncio.get_running_loop()
        for loop, session in sessions.items():
            if loop is current:
                await session.close()
            elif loop.is_running():
                # NOTE: not awaited: that loop may be blocked on this one (a sync call from async code).
                asyncio.run_coroutine_threadsafe(session.close(), loop)

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, tools: Sequence[ToolSpec] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:  # fmt: skip
        return ChatPrompt(messages, add_generation_prompt)

    async def prompt_images(self, prompt: str | list[int]) -> list[ImageInfo]:
        """The data-URL images of a chat prompt (``sdk.images.data_url_infos``: the server checks them with its limits)."""
        return await data_url_infos(prompt.messages) if isinstance(prompt, ChatPrompt) else []

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        if isinstance(request.prompt, ChatPrompt) and not request.prompt.add_generation_prompt:
            raise InvalidRequestError("a chat prefix (no generation prompt) cannot be generated from")
        if request.resume_token_ids is not None:
            raise InvalidRequestError.about("resume_token_ids", "continues an in-process run only")
        async for out in self._generate(request):
            yield out

    async def _generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        route: Route = "chat" if isinstance(request.prompt, ChatPrompt) else "completion"
        sampling = request.sampling.sampling_kwargs()
        body = to_wire(route, sampling)
        body.update(model=self.model_name, stream=True, return_token_ids=True)
        body["stream_options"] = {"include_usage": True}
        if request.priority:
            body["priority"] = request.priority
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        body.update(format_to_wire(request.response_format))
        if isinstance(request.prompt, ChatPrompt):
            url = self._base + "/chat/completions"
            body["messages"] = [message_to_wire(m) for m in request.prompt.messages]
            if request.tools is not None:
                body["tools"] = [t.model_dump(exclude_none=True) for t in request.tools]
                body["tool_choice"] = _tool_choice_to_wire(request.tool_choice)
                body["parallel_tool_calls"] = request.parallel_tool_calls
            if request.chat_template_kwargs:
                body["chat_template_kwargs"] = request.chat_template_kwargs
        else:
            url = self._base + "/completions"
            body["prompt"] = request.prompt if isinstance(request.prompt, list) else str(request.prompt)
        headers = {**self._headers, "X-Request-Id": request.request_id}
        async with self._client().post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                await _json_or_raise(resp)
            self._open[request.request_id] = resp
            try:
                async for delta in _read_stream(resp, request.request_id, sampling.get("n") or 1):
                    yield delta
            finally:
                self._open.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        # NOTE: closing the connection is how an HTTP client aborts; the server frees the blocks.
        resp = self._open.pop(request_id, None)
        if resp is not None:
            resp.close()

    async def pin_prefix(self, prompt: str | list[int], cache_salt: str | None = None) -> PrefixPin:
        """Warm the remote prefix cache with ``prompt`` (one generated token).

        A remote server cannot hold blocks for a client, so the pin is advisory: the
        server's prefix cache keeps the blocks while they are reused. A chat prefix is sent
        with the server's generation prompt, so the pin's ``token_ids`` end with it.
        """
        request = EngineRequest(f"pin-{uuid.uuid4().hex}", prompt, SamplingOptions(max_tokens=1), cache_salt=cache_salt)
        prompt_ids: list[int] = []
        num_cached = 0
        async for delta in self._generate(request):
            prompt_ids = delta.prompt_token_ids or prompt_ids
            num_cached = delta.usage.cached_tokens if delta.usage is not None else num_cached
        return PrefixPin(pin_id=request.request_id, token_ids=prompt_ids, num_cached_tokens=num_cached)

    async def embed(self, inputs: Sequence[str | list[int]], params: PoolingParams) -> Pooled:
        body = {"model": self.model_name, "input": list(inputs), "encoding_format": "float", **_pooling_fields(params)}
        out = await self._post("/embeddings", body)
        data = sorted(out["data"], key=lambda d: d["index"])
        return Pooled([d["embedding"] for d in data], int(out["usage"]["prompt_tokens"]), out.get("model"))

    async def score(self, query: str | Sequence[str], documents: Sequence[str], params: PoolingParams) -> Pooled:
        text_1 = query if isinstance(query, str) else list(query)
        body = {"model": self.model_name, "text_1": text_1, "text_2": list(documents), **_pooling_fields(params)}
        try:
            out = await self._post("/score", body)
        except (InvalidRequestError, ContentBlocked) as exc:  # NOTE: the route's names for the SDK's fields
            if not exc.param:
                raise
            raise exc.at(exc.param.replace("text_1", "query", 1).replace("text_2", "documents", 1)) from None
        data = sorted(out["data"], key=lambda d: d["index"])
        return Pooled([float(d["score"]) for d in data], int(out["usage"]["prompt_tokens"]), out.get("model"))

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self._client().post(self._base + path, json=body, headers=self._headers) as resp:
            return await _json_or_raise(resp)

    async def unpin_prefix(self, pin_id: str) -> None:
        return None

    async def retrieve(self, request_id: str) -> CompletionResult:
        """``GET /v1/chat/completions/{id}`` (``/v1/completions/{id}`` for a ``cmpl-`` id): the server waits for the
        replay of the journalled request and answers its whole result.

        Raises:
            NotFoundError: the server has no such request (``param="completion_id"``).
            EngineRestarting: the server is not reachable, or answers 503 (starting, draining, restarting).
            PagedError: the server's other answers (``from_wire``).
        """
        route = "completions" if request_id.startswith("cmpl-") else "chat/completions"
        try:
            async with self._client().get(f"{self._base}/{route}/{request_id}", headers=self._headers) as resp:
                try:
                    return result_from_wire(await _json_or_raise(resp))
                except EngineFailure as exc:
                    if resp.status != 503:
                        raise
                    # NOTE: a server starting, draining or restarting its engine: the result may come later
                    raise EngineRestarting(str(exc), retry_after=_retry_after(resp.headers.get("Retry-After")) or 1.0) from None
        except aiohttp.ClientConnectionError as exc:
            raise EngineRestarting(f"{self._base} is not reachable ({exc}): the server may be restarting") from exc

    def stats(self) -> dict[str, Any]:
        """Nothing: a remote engine's figures are on its ``/metrics`` route."""
        return {}

    async def respond(self, request: Any) -> AsyncIterator[ResponseEvent]:
        """``POST /v1/responses``, streamed: the server keeps the conversation. Errors before the first event raise here.

        Raises:
            PagedError: the server's answer (``from_wire``): ``NotFoundError`` for an unknown
                ``previous_response_id``, ``InvalidRequestError`` naming the field ...
        """
        body = request.model_dump(mode="json", exclude_none=True, exclude={"stream"})
        body.update(stream=True, model=request.model or self.model_name)
        resp = await self._client().post(self._base + "/responses", json=body, headers=self._headers)
        if resp.status != 200:
            async with resp:
                await _json_or_raise(resp)
        return _response_events(resp)


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style server-sent event stream, up to ``data: [DONE]``."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


async def _read_stream(resp: aiohttp.ClientResponse, request_id: str, num_choices: int) -> AsyncIterator[Delta]:
    """SSE events -> deltas of each choice; a choice's ``finish_reason`` closes it.

    The request's last delta waits for the usage event (it carries the cached-token count) and
    has the request's usage: its prompt's tokens and the tokens the deltas carried.
    """
    prompt_ids: list[int] = []
    sent_prompt = False
    num_tokens = num_cached = 0
    latency: RequestLatency | None = None
    finished: set[int] = set()
    last: Delta | None = None
    async for event in sse_events(resp):
        if "error" in event:
            raise from_wire(resp.status, event["error"])
        usage = event.get("usage")
        if usage:
            num_cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
            if usage.get("latency"):  # ``paged serve``'s extension; other servers have none
                latency = RequestLatency(**usage["latency"])
        prompt_ids = event.get("prompt_token_ids") or prompt_ids
        for choice in event.get("choices") or ():
            text = choice.get("text")
            message = choice.get("delta") or {}
            if text is None:
                text = message.get("content") or ""
            # NOTE: vLLM and paged serve send reasoning_content; newer servers name it reasoning
            reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
            token_ids = list(choice.get("token_ids") or ())
            prompt_ids = choice.get("prompt_token_ids") or prompt_ids  # completions: per choice
            index = int(choice.get("index") or 0)
            finish_reason = choice.get("finish_reason")
            logprobs = _logprobs(choice.get("logprobs"))
            calls = [tool_call_delta_from_wire(c) for c in message.get("tool_calls") or ()] or None
            if finish_reason is not None:
                finished.add(index)
            if not (text or reasoning or token_ids or logprobs or finish_reason or calls):
                continue
            delta = Delta(request_id, index, text, token_ids, logprobs, finish_reason, tool_calls=calls, reasoning=reasoning)
            if prompt_ids and not sent_prompt:
                delta.prompt_token_ids, sent_prompt = list(prompt_ids), True
            num_tokens += len(token_ids)
            if len(finished) == num_choices and finish_reason is not None:
                last = delta
            else:
                yield delta
    if last is None:
        raise EngineFailure("the server closed the stream before the request finished")
    if not sent_prompt and prompt_ids:
        last.prompt_token_ids = list(prompt_ids)
    last.usage = Usage(len(prompt_ids), num_tokens, num_cached, latency)
    yield last


def result_from_wire(body: dict[str, Any]) -> CompletionResult:
    """A chat completion (``ChatResult``) or a completion (``CompletionResult``) object as the SDK's result."""
    chat = body.get("object") == "chat.completion"
    choices = []
    for raw in body["choices"]:
        message = raw.get("message") or {}
        choices.append(Choice(
            index=int(raw.get("index") or 0), text=(message.get("content") if chat else raw.get("text")) or "",
            reasoning=message.get("reasoning_content") or message.get("reasoning") or None,
            token_ids=list(raw.get("token_ids") or ()), finish_reason=raw.get("finish_reason") or "stop",
        ))  # fmt: skip
    raw_usage = body.get("usage") or {}
    usage = Usage(
        int(raw_usage.get("prompt_tokens") or 0), int(raw_usage.get("completion_tokens") or 0),
        int((raw_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
    )  # fmt: skip
    kind = ChatResult if chat else CompletionResult
    return kind(request_id=str(body["id"]), model=str(body.get("model") or ""), choices=choices, usage=usage)


async def _response_events(resp: aiohttp.ClientResponse) -> AsyncIterator[ResponseEvent]:
    """A streamed response's events; closing them closes the connection (the server aborts the reply)."""
    async with resp:
        async for event in sse_events(resp):
            if "error" in event and "sequence_number" not in event:
                raise from_wire(resp.status, event["error"])
            yield ResponseEvent.model_validate(event)


def _pooling_fields(params: PoolingParams) -> dict[str, Any]:
    """``params`` as the pooling routes' fields (vLLM's names); ``dimensions`` only when set."""
    fields = dataclasses.asdict(params)
    if fields["dimensions"] is None:
        del fields["dimensions"]
    return fields


def _tool_choice_to_wire(choice: str | None) -> Any:
    if choice in (None, "auto", "none", "required"):
        return choice or "auto"
    return {"type": "function", "function": {"name": choice}}


def _logprobs(raw: dict[str, Any] | None) -> list[TokenLogprob] | None:
    """A choice's logprobs in either OpenAI format: chat (``content``) or legacy completions (parallel lists)."""
    if not raw:
        return None
    if "content" in raw:
        return [
            TokenLogprob(
                token=t["token"],
                logprob=t["logprob"],
                top_logprobs=[TopLogprob(token=c["token"], logprob=c["logprob"]) for c in t.get("top_logprobs") or ()],
            )
            for t in raw["content"] or ()
        ]
    tokens, values = raw.get("tokens") or [], raw.get("token_logprobs") or []
    tops = list(raw.get("top_logprobs") or ()) + [None] * len(tokens)
    return [
        TokenLogprob(
            token=token,
            logprob=float("-inf") if logprob is None else logprob,
            top_logprobs=[TopLogprob(token=s, logprob=lp) for s, lp in (top or {}).items()],
        )
        for token, logprob, top in zip(tokens, values, tops)
    ]


async def _json_or_raise(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        body = await resp.json(content_type=None)
    except (json.JSONDecodeError, aiohttp.ContentTypeError, UnicodeDecodeError):
        body = None
    if resp.status == 200 and isinstance(body, dict):
        return body
    error = body.get("error") if isinstance(body, dict) else None
    raise from_wire(resp.status, error if isinstance(error, dict) else {"message": resp.reason or ""},
                    _retry_after(resp.headers.get("Retry-After")))


def _retry_after(header: str | None) -> float | None:
    """``Retry-After`` in seconds (the delta-seconds form); None when absent or a date."""
    try:
        return max(float(header), 0.0) if header is not None else None
    except ValueError:
        return None
