"""Route handlers: OpenAI request bodies in, SDK calls, OpenAI response bodies (or SSE) out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from integrations.openai_server import protocol as p
from integrations.openai_server.errors import RETRY_AFTER, ApiError, bad_request, from_sdk
from integrations.openai_server.journal import JournalEntry
from integrations.openai_server.intake import check_common, origin, parse_body, sdk_requests
from integrations.openai_server.metrics import CONTENT_TYPE
from integrations.openai_server.policy import Tenant
from integrations.openai_server.relay import RELAY, Continuation, marker
from integrations.openai_server.wire_pieces import chat_logprobs, completion_logprobs, token_ids, usage
from integrations.openai_server.serving import Serving
from integrations.openai_server.sse import EventStream
from integrations.openai_server.state import STATE, TENANT, ServerState, cancel_on_disconnect, route_request
from sdk.errors import PagedError, RequestJournalled
from sdk.tools import collect_calls
from sdk.types import Delta
from sdk.wire import Route, tool_call_delta_to_wire, tool_call_to_wire

ReplyT = TypeVar("ReplyT", bound=p.Reply)
logger = logging.getLogger(__name__)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)


def _state(request: web.Request) -> ServerState:
    return request.app[STATE]


def _tenant(request: web.Request) -> Tenant:
    return request[TENANT]


async def health(request: web.Request) -> web.Response:
    """``{"status", "restarts", "last_error"}``: 200 while serving, 503 otherwise."""
    healthy, body = _state(request).health()
    return web.json_response(body, status=200 if healthy else 503)


async def metrics(request: web.Request) -> web.Response:
    body = _state(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def models(request: web.Request) -> web.Response:
    state = _state(request)
    state.require_serving()
    cards = [
        p.ModelCard(id=s.model_name, max_model_len=s.max_model_len)
        for s in state.servings() if _tenant(request).may_use_model(s.model_name)
    ]  # fmt: skip
    return _json(p.ModelList(data=cards))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    state.require_serving()
    body = await parse_body(request, p.ChatCompletionRequest, _tenant(request))
    serving = route_request(request, body.model)
    check_common(body, serving, _tenant(request))
    return await _Run(request, state, serving, body, "chat").execute()


async def completions(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    state.require_serving()
    body = await parse_body(request, p.CompletionRequest, _tenant(request))
    serving = route_request(request, body.model)
    check_common(body, serving, _tenant(request))
    prompts = body.prompts()
    if not prompts or any(len(x) == 0 for x in prompts):
        raise bad_request("prompt must not be empty", param="prompt")
    return await _Run(request, state, serving, body, "completion").execute()


def reply_message(deltas: list[Delta]) -> p.ChatMessage:
    """A chat choice's reply: its text, its reasoning (absent when none) and its complete tool
    calls (content null when only calls)."""
    text = "".join(d.text for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas) or None
    calls = collect_calls([c for d in deltas for c in d.tool_calls or ()])
    if not calls:
        return p.ChatMessage(content=text, reasoning_content=reasoning)
    return p.ChatMessage(content=text or None, reasoning_content=reasoning, tool_calls=[tool_call_to_wire(call) for call in calls])


def _continuation(request: web.Request) -> Continuation | None:
    """The continuation the fleet's ingress offered for ``request`` (through its replica); None for any other request."""
    relay = request.app.get(RELAY)
    if relay is None:
        return None
    try:
        return relay.take(request)
    except KeyError:
        raise bad_request("the continuation this request names is not known (or was taken)") from None


def _json(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(
        text=model.model_dump_json(exclude_none=True), status=status, content_type="application/json"
    )


class _Run:
    """One chat or completion request from admission to its terminal answer."""

    def __init__(
        self,
        request: web.Request,
        state: ServerState,
        serving: Serving,
        body: Any,
        route: Route,
    ) -> None:
        self.request = request
        self.state = state
        self.serving = serving
        self.body = body
        self.route = route
        self.is_chat = route == "chat"
        self.want_logprobs = bool(body.logprobs) if self.is_chat else body.logprobs is not None
        self.events = EventStream(request)
        self.text_offsets: dict[int, int] = {}  # choice index -> chars streamed (completion logprobs)
        self.num_choices = body.n or 1  # per SDK request: choice i is completion i % n of request i // n
        self.prompt_ids: dict[int, list[int]] = {}  # SDK request -> its prompt's ids (on its first delta)
        tenant = _tenant(request)
        self.tenant = tenant.name
        self.client = serving.client(tenant.name, tenant.policy)
        self.requests, self.format_field = sdk_requests(body, route)
        self.got: list[Delta] = []  # what the caller received (streamed) or the server holds (not): a journal entry's
        relay = request.app.get(RELAY)
        # NOTE: the fleet's ingress reads each event's tokens (relay.marker) to go on elsewhere if this replica dies
        self.relays_tokens = relay is not None and relay.is_relayed(request) and self._can_relay()
        self.continuation = _continuation(request)
        if self.continuation is not None and not self.relays_tokens:
            raise bad_request("a continuation goes on with a stream of one completion without tools or logprobs")
        cont = self.continuation
        self.request_id = cont.request_id if cont else p.random_id("chatcmpl" if self.is_chat else "cmpl")
        self.created = cont.created if cont else p.now()

    @property
    def can_continue(self) -> bool:
        """One completion of one prompt, without tools or logprobs: a run a continuation can go on with."""
        one_completion = len(self.requests) == 1 and self.num_choices == 1
        return one_completion and not getattr(self.body, "tools", None) and not self.want_logprobs

    def _can_relay(self) -> bool:
        """A stream the fleet can go on with on another replica: its reply's reasoning is not parsed here."""
        return bool(self.body.stream) and self.can_continue and not (self.is_chat and self.serving.parses_reasoning)

    async def execute(self) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        with self.state.track(self.request_id, task) as shutdown, cancel_on_disconnect(self.request, task):
            try:
                return await self._execute()
            except asyncio.CancelledError:
                if not shutdown.is_set():
                    raise  # the client went away: nothing to answer
                task.uncancel()
                return await self._shutdown_answer()

    async def _execute(self) -> web.StreamResponse:
        try:
            resume = None if self.continuation is None else list(self.continuation.token_ids)
            stream = await self.serving.open(self.client, self.request_id, self.requests, origin(self.request), resume)
        except PagedError as exc:
            raise from_sdk(exc, self.route, self.format_field) from None
        if self.continuation is not None:
            self.state.metrics.requests_continued.inc()
        async with contextlib.aclosing(stream):
            try:
                if self.body.stream:
                    return await self._stream(stream)
                return await self._collect(stream)
            except PagedError as exc:
                error = from_sdk(exc, self.route, self.format_field)
                if not self.events.started:
                    raise error from None
                await self.events.send(error.body())
                return await self.events.done()

    async def _shutdown_answer(self) -> web.StreamResponse:
        error = self._journal() or ApiError(503, "the server shut down before the request finished", code="shutdown")
        if not self.events.started:
            return error.response()
        with contextlib.suppress(ConnectionError):
            await self.events.send(error.body())
            await self.events.done()
        return self.events.response

    def _journal(self) -> ApiError | None:
        """Writes the request to the journal when it is on and the request can be continued; its answer, or None."""
        journal = self.state.journal
        if journal is None or not self.can_continue:
            return None
        entry = JournalEntry(
            self.request_id, self.route, self.tenant, self.serving.model_name,
            self.body.model_dump(mode="json", exclude_unset=True), token_ids(self.got),
            "".join(d.text for d in self.got), "".join(d.reasoning for d in self.got), self.created,
        )  # fmt: skip
        try:
            journal.write(entry)
        except OSError:
            logger.exception("journal: could not write %s", self.request_id)
            return None
        route = "chat/completions" if self.is_chat else "completions"
        message = (
            f"the server shut down before the request finished; it was journalled as {self.request_id}: "
            f"a server restarted on the same kv_cache_dir finishes it (GET /v1/{route}/{self.request_id})"
        )
        return ApiError(503, message, code=RequestJournalled.code, headers={"Retry-After": RETRY_AFTER}, request_id=self.request_id)

    # ------------------------------------------------------------------ non-streaming

    def _prompt_ids(self, delta: Delta) -> list[int]:
        """The prompt ids of the SDK request ``delta`` belongs to; a request's first delta carries them."""
        request = delta.index // self.num_choices
        if delta.prompt_token_ids is not None:
            self.prompt_ids[request] = delta.prompt_token_ids
        return self.prompt_ids.get(request, [])

    async def _collect(self, stream: AsyncIterator[Delta]) -> web.Response:
        choices: dict[int, list[Delta]] = {}
        async for delta in stream:
            self._prompt_ids(delta)
            choices.setdefault(delta.index, []).append(delta)
            self.got.append(delta)
        totals = usage([c[-1] for c in choices.values()])
        ordered = [choices[i] for i in sorted(choices)]
        want_ids = self.body.return_token_ids
        if self.is_chat:
            chat = self._reply(
                p.ChatCompletionResponse,
                choices=[
                    p.ChatChoice(
                        index=c[0].index,
                        message=reply_message(c),
                        logprobs=chat_logprobs(c) if self.want_logprobs else None,
                        finish_reason=c[-1].finish_reason,
                        token_ids=token_ids(c) if want_ids else None,
                    )
                    for c in ordered
                ],
                usage=totals,
                prompt_token_ids=list(self._prompt_ids(ordered[0][-1])) if want_ids else None,
            )
            return _json(chat)
        completion = self._reply(
            p.CompletionResponse,
            choices=[
                p.CompletionChoice(
                    index=c[0].index,
                    text="".join(d.text for d in c),
                    logprobs=completion_logprobs(c) if self.want_logprobs else None,
                    finish_reason=c[-1].finish_reason,
                    token_ids=token_ids(c) if want_ids else None,
                    prompt_token_ids=list(self._prompt_ids(c[-1])) if want_ids else None,
                )
                for c in ordered
            ],
            usage=totals,
        )
        return _json(completion)

    # ------------------------------------------------------------------ streaming

    async def _stream(self, stream: AsyncIterator[Delta]) -> web.StreamResponse:
        started: set[int] = set() if self.continuation is None else {0}  # NOTE: a continuation's opening went out
        finals: list[Delta] = []
        want_ids = self.body.return_token_ids
        first = self.continuation is None
        async for delta in stream:
            prompt_ids = self._prompt_ids(delta)
            event_prompt_ids = list(prompt_ids) if want_ids and (first or not self.is_chat) else None
            first = False
            if self.is_chat and delta.index not in started:
                started.add(delta.index)
                opening = p.DeltaMessage(role="assistant", content="")
                await self.events.send(self._chat_chunk(delta.index, opening), lead=self._marker(None))
            if delta.text or delta.reasoning or delta.token_ids or delta.tool_calls or delta.finish_reason is not None:
                # NOTE: before the send: its bytes reach the transport before the send can be cancelled
                self.got.append(delta)
                await self.events.send(self._event(delta, event_prompt_ids), lead=self._marker(delta))
            if delta.finish_reason is not None:
                finals.append(delta)
        if self.body.include_usage():
            kind = p.ChatCompletionChunk if self.is_chat else p.CompletionResponse
            await self.events.send(self._reply(kind, choices=[], usage=usage(finals)))
        return await self.events.done()

    def _marker(self, delta: Delta | None) -> bytes:
        """The relay's line before an event (the tokens it carries), for the fleet's ingress; nothing otherwise."""
        if not self.relays_tokens:
            return b""
        if delta is None:
            return marker(self.request_id, self.created, [], False)
        return marker(self.request_id, self.created, delta.token_ids, delta.finish_reason is not None)

    def _event(self, delta: Delta, prompt_ids: list[int] | None) -> BaseModel:
        ids = delta.token_ids if self.body.return_token_ids else None
        if self.is_chat:
            calls = [tool_call_delta_to_wire(c) for c in delta.tool_calls] if delta.tool_calls else None
            event = self._chat_chunk(
                delta.index,
                p.DeltaMessage(content=delta.text or None, reasoning_content=delta.reasoning or None, tool_calls=calls),
                logprobs=chat_logprobs([delta]) if self.want_logprobs else None,
                finish_reason=delta.finish_reason,
                token_ids=ids,
            )
            event.prompt_token_ids = prompt_ids
            return event
        logprobs = None
        if self.want_logprobs:
            # NOTE: text_offset counts from the start of the choice's text, across deltas.
            offset = self.text_offsets.get(delta.index, 0)
            logprobs = completion_logprobs([delta], offset)
            self.text_offsets[delta.index] = offset + sum(map(len, logprobs.tokens))
        return self._reply(
            p.CompletionResponse,
            choices=[
                p.CompletionChoice(
                    index=delta.index,
                    text=delta.text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    token_ids=ids,
                    prompt_token_ids=prompt_ids,
                )
            ],
        )

    def _chat_chunk(self, index: int, delta: p.DeltaMessage, **choice: Any) -> p.ChatCompletionChunk:
        return self._reply(p.ChatCompletionChunk, choices=[p.ChatChunkChoice(index=index, delta=delta, **choice)])

    def _reply(self, kind: type[ReplyT], **fields: Any) -> ReplyT:
        """A ``kind`` of this request: its id, its creation time and the served model's name, with ``fields``."""
        return kind(id=self.request_id, created=self.created, model=self.serving.model_name, **fields)
