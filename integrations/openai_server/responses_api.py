"""The Responses API routes: ``POST /v1/responses`` and the stored responses under ``/v1/responses/{response_id}``.

Each request runs through its tenant's SDK client (hooks, policy, rate limits, as a chat does)
and the server's one ``sdk.responses.service.Responder``: one store of responses and one set of
conversation pins for every tenant, each entry keyed by its tenant, so a tenant never reads,
continues or deletes another's response (a 404, as an unknown id). The store is in memory, or
under ``<kv_cache_dir>/responses`` when the engine has a ``kv_cache_dir`` (a restart keeps it).

| route | answer |
| --- | --- |
| ``POST /v1/responses`` | the response, or its events (``event: <type>`` + ``data: {json}``) with ``stream`` |
| ``GET /v1/responses/{response_id}`` | the stored response |
| ``DELETE /v1/responses/{response_id}`` | ``{"id", "object": "response.deleted", "deleted": true}`` |
| ``GET /v1/responses/{response_id}/input_items`` | its conversation's items, a page (``limit``, ``order``, ``after``) |
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from integrations.openai_server.errors import RETRY_AFTER, ApiError, bad_request, from_sdk
from integrations.openai_server.intake import check_common, origin, parse_body
from integrations.openai_server.journal import JournalEntry
from integrations.openai_server.metrics import PREFIX
from integrations.openai_server.sse import EventStream
from integrations.openai_server.state import STATE, TENANT, cancel_on_disconnect, route_request
from sdk.errors import PagedError, RequestJournalled
from sdk.responses.config import ResponsesConfig
from sdk.responses.pins import RELEASE_REASONS
from sdk.responses.service import LOGPROBS_INCLUDE, Progress, Responder
from sdk.responses.store import ResponseStore
from sdk.responses.types import (
    TERMINAL_EVENTS,
    DeletedResponse,
    InputItemList,
    Response,
    ResponseEvent,
    ResponseRequest,
    new_id,
)

logger = logging.getLogger(__name__)

RESPONDER = web.AppKey("paged_responder", Responder)
# (tenant, response id) -> once a journal replay of that response ended; set by the journal's replays
REPLAYED = web.AppKey("paged_responses_replayed", Callable[[str, str], Awaitable[Any]])
DROP_REASONS = ("size", "age", "deleted")
MAX_PAGE = 100  # input items per page, as OpenAI's ``limit``
DEFAULT_PAGE = 20


def add_routes(app: web.Application, config: ResponsesConfig | None = None, kv_cache_dir: str | None = None) -> None:
    """The Responses routes, their responder (its store under ``kv_cache_dir``/responses when given) and its metrics."""
    config = config or ResponsesConfig()
    directory = Path(kv_cache_dir) / "responses" if kv_cache_dir is not None else None
    responder = Responder(config, ResponseStore(config, directory))
    app[RESPONDER] = responder
    app[STATE].metrics.registry.register(ResponsesCollector(responder))
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        yield
        # NOTE: the pins die with the engine, which saves them to kv_cache_dir as it closes
        await responder.pins.stop()
        responder.store.close()

    app.cleanup_ctx.append(lifetime)


async def create(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.require_serving()
    tenant = request[TENANT]
    body = await parse_body(request, ResponseRequest, tenant)
    serving = route_request(request, body.model)
    check_common(body, serving, tenant)
    client = serving.client(tenant.name, tenant.policy)
    task = asyncio.current_task()
    assert task is not None
    events = EventStream(request)
    progress = Progress()
    with state.track(new_id("responses"), task) as shutdown, cancel_on_disconnect(request, task):
        try:
            try:
                stream = await request.app[RESPONDER].open(
                    client, body, origin=origin(request), stream=body.stream, model=serving.model_name,
                    progress=progress,
                )
            except PagedError as exc:
                raise from_sdk(exc, None) from None
            async with contextlib.aclosing(stream):
                return await (_stream(events, stream) if body.stream else _collect(stream))
        except PagedError as exc:  # not streamed: the reply failed after its start
            raise from_sdk(exc, None) from None
        except asyncio.CancelledError:
            if not shutdown.is_set():
                raise  # the client went away: nothing to answer
            task.uncancel()
            error = _journal(request, body, progress, serving.model_name) or ApiError(
                503, "the server shut down before the response finished", code="shutdown"
            )
            if not events.started:
                return error.response()
            with contextlib.suppress(ConnectionError):
                await events.send(error.body())
                await events.end()
            return events.response


def _journal(request: web.Request, body: ResponseRequest, progress: Progress, model: str) -> ApiError | None:
    """Writes a response the drain cut off to the journal, when there is one and the response can go on: stored
    (its result is fetched by id), started, without tools or logprobs. Its answer, or None."""
    state = request.app[STATE]
    include = body.include or ()
    if (
        state.journal is None or not body.store or not progress.response_id or body.tools
        or body.top_logprobs is not None or LOGPROBS_INCLUDE in include
    ):  # fmt: skip
        return None
    entry = JournalEntry(
        progress.response_id, "response", request[TENANT].name, model,
        body.model_dump(mode="json", exclude_unset=True), progress.token_ids,
        "".join(d.text for d in progress.deltas), "".join(d.reasoning for d in progress.deltas), progress.created_at,
    )  # fmt: skip
    try:
        state.journal.write(entry)
    except OSError:
        logger.exception("journal: could not write %s", entry.request_id)
        return None
    message = (
        f"the server shut down before the response finished; it was journalled as {entry.request_id}: a server "
        f"restarted on the same kv_cache_dir finishes and stores it (GET /v1/responses/{entry.request_id})"
    )
    return ApiError(503, message, code=RequestJournalled.code, headers={"Retry-After": RETRY_AFTER}, request_id=entry.request_id)


async def _stream(events: EventStream, stream: AsyncIterator[ResponseEvent]) -> web.StreamResponse:
    async for event in stream:
        await events.send(event, event.type)
    return await events.end()


async def _collect(stream: AsyncIterator[ResponseEvent]) -> web.Response:
    response = None
    async for event in stream:
        if event.type in TERMINAL_EVENTS:
            response = event.response
    assert response is not None
    return _json(response)


async def retrieve(request: web.Request) -> web.Response:
    """The stored response; one a journal replay is finishing is answered once the replay ends."""
    replayed = request.app.get(REPLAYED)
    if replayed is not None:
        try:
            await replayed(request[TENANT].name, request.match_info["response_id"])
        except PagedError as exc:
            raise from_sdk(exc, None) from None
    return _json(_lookup(request).response)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    try:
        request.app[RESPONDER].delete(request[TENANT].name, response_id)
    except PagedError as exc:
        raise from_sdk(exc, None) from None
    return _json(DeletedResponse(id=response_id))


async def input_items(request: web.Request) -> web.Response:
    """A page of the response's conversation items: ``order`` asc or desc (default), up to ``limit``, ``after`` an item id."""
    items = list(_lookup(request).items)
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", param="order")
    try:
        limit = int(query.get("limit", DEFAULT_PAGE))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit must be an integer in [1, {MAX_PAGE}]", param="limit")
    if order == "desc":
        items.reverse()
    if "after" in query:
        ids = [item.get("id") for item in items]
        if query["after"] not in ids:
            raise ApiError(404, f"after: no input item {query['after']!r} in this response", param="after", code="not_found")
        items = items[ids.index(query["after"]) + 1 :]
    page = items[:limit]
    return _json(InputItemList(
        data=page, first_id=page[0].get("id") if page else None, last_id=page[-1].get("id") if page else None,
        has_more=len(items) > limit,
    ))  # fmt: skip


def _lookup(request: web.Request) -> Any:
    try:
        return request.app[RESPONDER].lookup(request[TENANT].name, request.match_info["response_id"], "response_id")
    except PagedError as exc:
        raise from_sdk(exc, None) from None


def _json(body: Response | DeletedResponse | InputItemList) -> web.Response:
    return web.Response(text=body.model_dump_json(), content_type="application/json")


class ResponsesCollector(Collector):
    """The store's and the pins' figures for ``/metrics`` (read at scrape time, after dropping what aged out)."""

    def __init__(self, responder: Responder) -> None:
        self._responder = responder

    def collect(self) -> Iterator[Any]:
        responder = self._responder
        responder.sweep()
        store, pins = responder.store, responder.pins
        yield GaugeMetricFamily(PREFIX + "responses_stored", "Stored responses.", value=len(store))
        yield GaugeMetricFamily(PREFIX + "responses_stored_bytes", "Bytes of the stored responses' JSON.", value=store.num_bytes)
        dropped = CounterMetricFamily(PREFIX + "responses_dropped", "Stored responses dropped, by reason.", labels=["reason"])
        for reason in DROP_REASONS:
            dropped.add_metric([reason], store.dropped[reason])
        yield dropped
        yield GaugeMetricFamily(PREFIX + "conversation_pins", "Conversations whose prefix is pinned in the KV cache.", value=pins.num_pins)
        yield GaugeMetricFamily(PREFIX + "conversation_pinned_tokens", "Tokens of the pinned conversations.", value=pins.num_tokens)
        released = CounterMetricFamily(PREFIX + "conversation_pins_released", "Conversation pins released, by reason.", labels=["reason"])
        for reason in RELEASE_REASONS:
            released.add_metric([reason], pins.released[reason])
        yield released
