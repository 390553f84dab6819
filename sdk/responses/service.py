"""Responder: Responses API requests run as chats of an SDK client, conversations kept in a store and pinned.

A request becomes one ``ChatRequest`` of the client (an ``sdk.AsyncClient``): its conversation (``sdk.responses.items``)
after its ``instructions``; ``tools`` as the SDK's tools, ``text.format`` as its
``response_format`` (a tool choice and a format together: ``sdk.tools.tool_constraint``),
``reasoning.effort`` as a chat-template variable, the sampling fields as the engine's knobs.
So a response meets everything a chat meets: the client's hooks, its tenant's policy and rate
limits, constraints held by the engine's grammar, the reasoning parser. The reply's deltas
become the response's items and events (``sdk.responses.events``).

A stored response (``store``, the default) keeps its conversation (``sdk.responses.store``); a
request with ``previous_response_id`` continues it, sending only its new items, and its model
sees the whole conversation. Once a stored response ends, its conversation is pinned in the
engine for the next turn (``sdk.responses.pins``): the turn after computes only what it adds.
Errors name the Responses fields (``input.2.call_id``, ``text.format.schema``, ``max_output_tokens``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from sdk.errors import InvalidRequestError, NotFoundError, PagedError
from sdk.fields import SAMPLING_FIELDS, invalid_request
from sdk.policy import ENGINE_MAX_TOKENS, engine_salt
from sdk.prompt_worker import PROMPT_WORKER
from sdk.responses.config import ResponsesConfig
from sdk.responses.events import ResponseBuilder
from sdk.responses.items import Conversation, call_ids, check_input
from sdk.responses.pins import ConversationPins
from sdk.responses.store import ResponseStore, StoredResponse
from sdk.responses.types import Response, ResponseEvent, ResponseRequest
from sdk.transport import InProcessTransport
from sdk.types import ChatRequest, Delta

if TYPE_CHECKING:
    from sdk.hooks import RequestOrigin
    from sdk.settings import ClientSettings
    from sdk.transport import Transport

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# SDK request fields -> the Responses fields that set them (the rest keep their names)
_WIRE_PARAMS = {
    "max_tokens": "max_output_tokens", "logprobs": "top_logprobs", "chat_template_kwargs": "reasoning",
    "response_format": "text.format", "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema.name": "text.format.name", "response_format.json_schema": "text.format",
}  # fmt: skip
_FORMAT_TYPES = ("text", "json_object", "json_schema")


class ChatClient(Protocol):
    """What a responder needs of the client whose chats run the responses (an ``sdk.AsyncClient``)."""

    settings: ClientSettings
    transport: Transport

    @property
    def model_name(self) -> str: ...

    async def start(self) -> None: ...

    def stream(
        self, messages: ChatRequest, *, origin: RequestOrigin | None = None, resume_token_ids: list[int] | None = None
    ) -> AsyncIterator[Delta]: ...


@dataclass
class Progress:
    """How far a response got: its id and creation time, and the deltas whose events its caller was sent (all of
    them so far for one not streamed). A server's drain journals it; a replay goes on from it (``Responder.open``)."""

    response_id: str = ""
    created_at: int = 0
    deltas: list[Delta] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]


class Responder:
    """Runs Responses API requests over clients of one engine, with one store and one set of pins.

    Args:
        config: the store's and the pins' bounds; None = ``ResponsesConfig()``.
        store: where stored responses are kept; None = a ``ResponseStore`` in memory with ``config``.
    """

    def __init__(self, config: ResponsesConfig | None = None, store: ResponseStore | None = None) -> None:
        self.config = config or ResponsesConfig()
        self.store = store if store is not None else ResponseStore(self.config)  # NOTE: an empty store is falsy
        self.pins = ConversationPins(self.config)

    async def open(
        self, client: ChatClient, request: Any, *, origin: RequestOrigin | None = None, stream: bool = True,
        model: str | None = None, progress: Progress | None = None, resume: Progress | None = None,
    ) -> AsyncIterator[ResponseEvent]:  # fmt: skip
        """Start ``request`` (a ``ResponseRequest``) on ``client``; its events, from ``response.created``.

        ``model`` is the model id the response names (a server's served name); None = the client's model.
        ``progress`` is filled as the events go: the response's id, then each delta before its events.
        ``resume`` goes on with a response another server cut off (in process, as a drain's journal
        replay does): the response keeps its id and creation time, its output starts with the deltas
        its caller received, and the engine generates only the rest.

        The reply's first output is awaited here, so a bad request, an unknown
        ``previous_response_id``, a refusal by a hook or the engine raise from this call,
        before any event. Closing the events early aborts the reply (nothing is stored).
        A failure after the start is a ``response.failed`` event when ``stream``, else raised
        from the events (an answer not streamed is all or nothing).

        Raises:
            InvalidRequestError: a field the request cannot have; ``param`` names it.
            NotFoundError: ``previous_response_id`` is not a stored response of the client's tenant.
            PagedError: as ``AsyncClient.stream``.
        """
        if (name := request.unsupported()) is not None:
            raise InvalidRequestError.about(name, "is not supported by this server")
        tenant = client.settings.tenant or ""
        previous = None
        if request.previous_response_id is not None:
            previous = self.lookup(tenant, request.previous_response_id, "previous_response_id")
            await self.pins.ready(previous.key)
        history = previous.conversation() if previous is not None else []
        conversation = Conversation(request.instructions, [*history, *check_input(request.input, call_ids(history))], len(history))
        cache_salt = request.cache_salt if request.cache_salt is not None or previous is None else previous.cache_salt
        chat = _chat_request(request, conversation, cache_salt)
        if request.truncation == "auto":
            conversation = await self._fit(client, tenant, conversation, chat)
            chat = chat.model_copy(update={"messages": conversation.messages})
        await client.start()
        response = _response(request, model or client.model_name)
        if resume is not None:
            response = response.model_copy(update={"id": resume.response_id, "created_at": resume.created_at})
            deltas = client.stream(chat, origin=origin, resume_token_ids=resume.token_ids)
        else:
            deltas = client.stream(chat, origin=origin)
        if progress is not None:
            progress.response_id, progress.created_at = response.id, response.created_at
        want_logprobs = chat.logprobs is not None
        try:
            first = await anext(deltas)
        except PagedError as exc:
            await deltas.aclose()  # type: ignore[attr-defined]
            raise _at_wire_param(exc, conversation) from None
        except BaseException:
            await deltas.aclose()  # type: ignore[attr-defined]
            raise
        run = _Run(self, client, request, conversation, chat, cache_salt, previous)
        received = resume.deltas if resume is not None else []
        builder = ResponseBuilder(response, want_logprobs=want_logprobs)
        return run.events(builder, [*received, first], deltas, stream, progress or Progress())

    def lookup(self, tenant: str, response_id: str, param: str) -> StoredResponse:
        """The tenant's stored response of that id.

        Raises:
            NotFoundError: none (unknown, expired, deleted, or another tenant's); ``param`` is the field that named it.
        """
        self.sweep()  # NOTE: what aged out goes with its pin
        stored = self.store.get(tenant, response_id)
        if stored is None:
            raise NotFoundError(f"{param}: no stored response {response_id!r} (unknown, expired or deleted)", param=param)
        return stored

    def delete(self, tenant: str, response_id: str, param: str = "response_id") -> None:
        """Delete the tenant's stored response and release its conversation's pin.

        Raises:
            NotFoundError: as ``lookup``.
        """
        self.lookup(tenant, response_id, param)
        self.store.delete(tenant, response_id)
        self.pins.release((tenant, response_id), "deleted")

    def sweep(self) -> None:
        """Drop the stored responses past their age (and their pins); release the pins past theirs."""
        for stored in self.store.expire():
            self.pins.release(stored.key, "dropped")
        self.pins.sweep()

    async def aclose(self) -> None:
        """Release every pin; finish writing the store."""
        await self.pins.aclose()
        self.store.close()

    async def _fit(self, client: ChatClient, tenant: str, conversation: Conversation, chat: ChatRequest) -> Conversation:
        """``truncation: auto``: the conversation without as few of its oldest items as its prompt needs to leave
        room for the reply within ``max_model_len`` (its last item always stays)."""
        await client.start()
        transport = client.transport
        room = transport.max_model_len - (chat.max_tokens or ENGINE_MAX_TOKENS)

        async def fits(candidate: Conversation) -> bool:
            prompt = await PROMPT_WORKER.run(
                tenant, transport.render_chat, candidate.messages, True, chat.tools, chat.chat_template_kwargs
            )  # fmt: skip
            return not isinstance(prompt, list) or len(prompt) <= room  # NOTE: a remote prompt is counted by its server

        most = len(conversation.items) - 1
        if most < 1 or await fits(conversation):
            return conversation
        low, high = 1, most
        while low < high:
            middle = (low + high) // 2
            if await fits(conversation.dropping(middle)):
                high = middle
            else:
                low = middle + 1
        return conversation.dropping(low)


class _Run:
    """One response after its start: its events, then storing and pinning it."""

    def __init__(
        self, responder: Responder, client: ChatClient, request: Any, conversation: Conversation, chat: ChatRequest,
        cache_salt: str | None, previous: StoredResponse | None,
    ) -> None:  # fmt: skip
        self.responder = responder
        self.client = client
        self.request = request
        self.conversation = conversation
        self.chat = chat
        self.cache_salt = cache_salt
        self.previous = previous

    async def events(
        self, builder: ResponseBuilder, opening: list[Delta], stream: AsyncIterator[Delta], report_failures: bool,
        progress: Progress,
    ) -> AsyncIterator[ResponseEvent]:  # fmt: skip
        """``opening``: the deltas already out of ``stream`` (a resumed response's received ones first)."""
        try:
            for event in builder.start():
                yield event
            pending = list(opening)
            delta: Delta | None = pending.pop(0)
            while delta is not None:
                if delta.usage is not None:  # the reply's last delta
                    events = builder.finish(delta)
                    await self._keep(builder.response)  # NOTE: before the last event: a client may continue it at once
                    for event in events:
                        yield event
                    return
                progress.deltas.append(delta)  # NOTE: before its events: they go out once yielded
                for event in builder.add(delta):
                    yield event
                delta = pending.pop(0) if pending else await anext(stream, None)
        except PagedError as exc:
            error = _at_wire_param(exc, self.conversation)
            if not report_failures:
                raise error from None
            for event in builder.fail(error):
                yield event
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _keep(self, response: Response) -> None:
        """Store the response, and pin its conversation in place of the one it continued."""
        if not self.request.store:
            return
        responder, tenant = self.responder, self.client.settings.tenant or ""
        stored = StoredResponse(tenant, response, self.conversation.items, self.cache_salt)
        for dropped in responder.store.put(stored):
            responder.pins.release(dropped.key, "dropped")
        if self.previous is not None:
            responder.pins.release(self.previous.key, "superseded")
        transport = self.client.transport
        if responder.store.get(tenant, response.id) is None or not isinstance(transport, InProcessTransport):
            return  # dropped at once (larger than the store), or a transport that cannot pin
        following = Conversation(self.request.instructions, stored.conversation(), len(stored.conversation()))
        if any(message.image_parts for message in following.messages):
            return  # NOTE: a pinned prefix is text only
        with contextlib.suppress(PagedError):
            token_ids = await PROMPT_WORKER.run(
                tenant, transport.render_chat, following.messages, False, self.chat.tools, self.chat.chat_template_kwargs
            )  # fmt: skip
            settings = self.client.settings
            salt = engine_salt(settings.policy, settings.tenant, self.cache_salt)
            block = transport.block_size
            capacity = block * (transport.stats().get("kv_blocks_total") or 0)
            reserve = -(-transport.max_model_len // block) * block  # NOTE: whole blocks
            responder.pins.pin(stored.key, transport, list(token_ids), salt, capacity, reserve)


def _chat_request(request: Any, conversation: Conversation, cache_salt: str | None) -> ChatRequest:
    """The ``ChatRequest`` a response runs as.

    Raises:
        InvalidRequestError: a tool, tool choice, format or knob the SDK refuses, named as the request spells it.
    """
    fields: dict[str, Any] = {name: getattr(request, name) for name in SAMPLING_FIELDS if name in ResponseRequest.model_fields}
    fields["max_tokens"] = request.max_output_tokens
    include = request.include or ()
    if request.top_logprobs is not None or LOGPROBS_INCLUDE in include:
        fields["logprobs"] = request.top_logprobs or 0
    template = None
    if request.reasoning is not None and request.reasoning.effort is not None:
        template = {"reasoning_effort": request.reasoning.effort}
        if request.reasoning.effort == "none":
            template["enable_thinking"] = False
    if request.priority is not None:
        fields["priority"] = request.priority
    try:
        return ChatRequest(
            messages=conversation.messages, tools=_tools(request.tools), tool_choice=_tool_choice(request.tool_choice),
            parallel_tool_calls=request.parallel_tool_calls, response_format=_format(request.text),
            chat_template_kwargs=template, cache_salt=cache_salt, **{k: v for k, v in fields.items() if v is not None},
        )  # fmt: skip
    except ValidationError as exc:
        raise _at_wire_param(invalid_request(exc), conversation) from None
    except InvalidRequestError as exc:
        raise _at_wire_param(exc, conversation) from None


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) as OpenAI chat tools; any other kind of tool is refused."""
    if tools is None:
        return None
    out = []
    for n, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise InvalidRequestError.about(f"tools.{n}.type", f"{tool.get('type')!r} tools are not supported; function tools are")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    """A Responses tool choice (a named one is ``{"type": "function", "name": ...}``) as the SDK's."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError.about("tool_choice", 'a named choice is {"type": "function", "name": ...}; other kinds are not supported')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as the SDK's ``response_format`` (the Responses spelling is flat)."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in _FORMAT_TYPES:
        raise InvalidRequestError.about("text.format.type", f"must be one of {', '.join(_FORMAT_TYPES)}")
    if kind != "json_schema":
        return {"type": kind}
    spec = {k: fmt[k] for k in ("name", "schema", "description", "strict") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": spec}


def _response(request: Any, model: str) -> Response:
    """The response as its request makes it, before any output."""
    return Response(
        model=model, instructions=request.instructions, max_output_tokens=request.max_output_tokens,
        metadata=request.metadata or {}, parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id, store=request.store, temperature=request.temperature,
        top_p=request.top_p, tools=request.tools or [], tool_choice=request.tool_choice or "auto",
        text={"format": (request.text.format if request.text is not None else None) or {"type": "text"}},
        reasoning={"effort": request.reasoning.effort, "summary": request.reasoning.summary} if request.reasoning else {"effort": None, "summary": None},
        truncation=request.truncation or "disabled", user=request.user,
    )  # fmt: skip


def _at_wire_param(exc: PagedError, conversation: Conversation) -> PagedError:
    """``exc`` naming the Responses field at fault, not the chat field the SDK named."""
    if not isinstance(exc, InvalidRequestError) or exc.param is None:
        return exc
    param = exc.param
    head, _, rest = param.partition(".")
    if head in ("messages", "prompt"):
        return exc.at(conversation.wire_param(param))
    for sdk_name in sorted(_WIRE_PARAMS, key=len, reverse=True):
        if param == sdk_name or param.startswith(sdk_name + "."):
            return exc.at(_WIRE_PARAMS[sdk_name] + param[len(sdk_name) :])
    return exc
