"""Replaying the journal: a server on the ``kv_cache_dir`` of one that drained finishes the requests it journalled.

At start-up (once the engines serve) each ``journal.JournalEntry`` of a served chat model is run on that model
again through its tenant's SDK client as a continuation of what its caller received
(``AsyncClient.stream(resume_token_ids=...)``, the engine's resume path): the prompt is rendered
again, its KV comes from the prefix cache the drained server saved, and only the rest is
generated. The whole result (what the caller got, then the rest) is kept by request id in a
bounded store, and the entry leaves the journal. A client fetches it with
``GET /v1/chat/completions/{completion_id}`` (OpenAI's stored chat completion route; a
completion's at ``GET /v1/completions/{completion_id}``), which waits while the replay runs. A
Responses API entry goes on through the server's responder (``Responder.open(resume=...)``) under
its id and creation time, and is stored: ``GET /v1/responses/{response_id}`` waits for it.

An entry that cannot be replayed (another model, a tenant the policy no longer has, a body or
tokens the engine refuses) is logged and skipped; start-up goes on. A replay the admission or
rate limits refuse waits and tries again (``REPLAY_RETRIES`` times). A replay cut short by
another shutdown leaves its entry in the journal, for the next server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel

from integrations.openai_server import protocol as p
from integrations.openai_server.errors import ApiError, from_sdk
from integrations.openai_server.intake import sdk_requests
from integrations.openai_server.journal import JournalEntry, RequestJournal
from integrations.openai_server.responses_api import REPLAYED, RESPONDER
from integrations.openai_server.routes import reply_message
from integrations.openai_server.wire_pieces import token_ids, usage
from sdk.errors import EngineRestarting, InvalidRequestError, OverloadedError, PagedError
from sdk.responses.service import Progress, Responder
from sdk.responses.types import TERMINAL_EVENTS, ResponseRequest
from sdk.types import Delta

if TYPE_CHECKING:
    from integrations.openai_server.serving import Serving
    from integrations.openai_server.state import ServerState

logger = logging.getLogger(__name__)

MAX_RESULTS = 1024  # replayed results kept; past it the oldest finished ones are dropped
REPLAY_RETRIES = 8  # a replay the admission or rate limits refuse is tried again, waiting from REPLAY_BACKOFF, doubling
REPLAY_BACKOFF = 0.05
_BODIES: dict[str, type[BaseModel]] = {
    "chat": p.ChatCompletionRequest, "completion": p.CompletionRequest, "response": ResponseRequest,
}  # fmt: skip


class JournalReplays:
    """The journal's replays and their results, by tenant and request id.

    Args:
        journal: the journal of the ``kv_cache_dir``.
        max_results: results kept (finished ones, oldest dropped first).
    """

    def __init__(self, journal: RequestJournal, max_results: int = MAX_RESULTS) -> None:
        self.journal = journal
        self.max_results = max_results
        self._results: OrderedDict[tuple[str, str], asyncio.Future[BaseModel]] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self.responder: Responder | None = None  # the server's, for Responses API entries (``add_routes``)

    def start(self, state: ServerState, servings: Sequence[Serving]) -> int:
        """Starts replaying every entry of the journal on the chat model it was journalled for (one of
        ``servings``); returns how many started."""
        for entry in self.journal.load():
            serving = next((s for s in servings if s.model_name == entry.model), servings[0])
            try:
                requests = self._requests(state, serving, entry)
            except (ApiError, KeyError, ValueError) as exc:  # NOTE: a pydantic ValidationError is a ValueError
                self._skip(entry, _why(exc), remove=not isinstance(exc, _OtherModel))
                continue
            future: asyncio.Future[BaseModel] = asyncio.get_running_loop().create_future()
            future.add_done_callback(_retrieved)  # NOTE: a failure nobody fetched is logged once, by _skip
            self._results[(entry.tenant, entry.request_id)] = future
            task = asyncio.ensure_future(self._replay(serving, entry, requests, future, state))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self._tasks:
            logger.info("journal: replaying %d requests from %s", len(self._tasks), self.journal.directory)
        return len(self._tasks)

    async def result(self, tenant: str, request_id: str) -> BaseModel | None:
        """The tenant's replayed result of ``request_id``, once finished; None when there is none.

        Raises:
            PagedError: the replay failed (the engine refused or failed it).
            ApiError: the server shut down before it finished (503 ``shutdown``).
        """
        future = self._results.get((tenant, request_id))
        if future is None:
            return None
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.cancelled():
                raise  # the caller went away
            raise ApiError(503, "the server shut down before the replay finished", code="shutdown") from None

    async def stop(self) -> None:
        """Cancels the replays still running: their entries stay in the journal for the next server."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for future in self._results.values():
            if not future.done():
                future.cancel()

    # ------------------------------------------------------------------ one replay

    def _requests(self, state: ServerState, serving: Serving, entry: JournalEntry) -> list[Any]:
        if entry.model != serving.model_name:
            raise _OtherModel(f"model: journalled for {entry.model!r}, this server serves {serving.model_name!r}")
        body = _BODIES[entry.route].model_validate(entry.body)
        if entry.route == "response":
            if self.responder is None:
                raise _OtherModel("route: this server does not serve the Responses API")
            state.policy.tenant(entry.tenant)
            return [body]
        requests, _ = sdk_requests(body, entry.route)  # type: ignore[arg-type]
        if len(requests) != 1 or (requests[0].n or 1) != 1:
            raise ApiError(400, "body: a journal entry continues one completion of one prompt")
        state.policy.tenant(entry.tenant)  # NOTE: KeyError for a tenant the policy no longer has
        return requests

    async def _replay(
        self, serving: Serving, entry: JournalEntry, requests: list[Any], future: asyncio.Future[BaseModel],
        state: ServerState,
    ) -> None:  # fmt: skip
        tenant = state.policy.tenant(entry.tenant)
        client = serving.client(tenant.name, tenant.policy)
        received = Delta(entry.request_id, 0, entry.text, list(entry.token_ids), reasoning=entry.reasoning)
        if entry.route == "response":
            await self._replay_response(client, serving.model_name, entry, requests[0], received, future)
            return
        request = requests[0].model_copy(update={"request_id": entry.request_id})
        deltas = [received]
        for attempt in range(REPLAY_RETRIES + 1):
            if entry.route == "chat":
                stream = client.stream(request, resume_token_ids=list(entry.token_ids))
            else:
                stream = client.stream(prompt=request, resume_token_ids=list(entry.token_ids))
            try:
                async with contextlib.aclosing(stream):
                    async for delta in stream:
                        deltas.append(delta)
                break
            except (OverloadedError, EngineRestarting) as exc:  # NOTE: refused before it started: try again later
                if len(deltas) == 1 and attempt < REPLAY_RETRIES:
                    await asyncio.sleep(max(REPLAY_BACKOFF * 2**attempt, getattr(exc, "retry_after", 0.0)))
                    continue
                self._skip(entry, f"{type(exc).__name__}: {exc}", remove=False)
                future.set_exception(exc)
                return
            except PagedError as exc:  # NOTE: refused (kept no more); failed (left for the next server)
                self._skip(entry, f"{type(exc).__name__}: {exc}", remove=isinstance(exc, InvalidRequestError))
                future.set_exception(exc)
                return
        future.set_result(_result(entry, serving.model_name, deltas))
        self.journal.remove(entry.request_id)
        self._shrink()

    async def _replay_response(
        self, client: Any, model: str, entry: JournalEntry, body: Any, received: Delta,
        future: asyncio.Future[BaseModel],
    ) -> None:
        """A Responses API entry: the response goes on under its id and is stored (``GET /v1/responses/{id}``)."""
        assert self.responder is not None
        resume = Progress(entry.request_id, entry.created, [received] if received.token_ids else [])
        response = None
        for attempt in range(REPLAY_RETRIES + 1):
            try:
                events = await self.responder.open(client, body, stream=False, model=model, resume=resume)
            except (OverloadedError, EngineRestarting) as exc:  # NOTE: refused before it started: try again later
                if attempt < REPLAY_RETRIES:
                    await asyncio.sleep(max(REPLAY_BACKOFF * 2**attempt, getattr(exc, "retry_after", 0.0)))
                    continue
                self._skip(entry, f"{type(exc).__name__}: {exc}", remove=False)
                future.set_exception(exc)
                return
            except PagedError as exc:
                self._skip(entry, f"{type(exc).__name__}: {exc}", remove=isinstance(exc, InvalidRequestError))
                future.set_exception(exc)
                return
            try:
                async with contextlib.aclosing(events):
                    async for event in events:
                        if event.type in TERMINAL_EVENTS:
                            response = event.response
            except PagedError as exc:  # NOTE: failed after its start: left for the next server
                self._skip(entry, f"{type(exc).__name__}: {exc}", remove=False)
                future.set_exception(exc)
                return
            break
        assert response is not None
        future.set_result(response)
        self.journal.remove(entry.request_id)
        self._shrink()

    def _skip(self, entry: JournalEntry, why: str, remove: bool) -> None:
        logger.warning("journal: entry %s cannot be replayed here (%s); skipped", entry.request_id, why)
        if remove:
            self.journal.remove(entry.request_id)

    def _shrink(self) -> None:
        finished = [key for key, future in self._results.items() if future.done()]
        for key in finished[: max(0, len(self._results) - self.max_results)]:
            del self._results[key]


class _OtherModel(ValueError):
    """An entry of another model: left in the journal for a server of that model."""


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _why(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"tenant: {exc.args[0]!r} is not in the policy"
    if isinstance(exc, ApiError):
        return exc.message
    return str(exc).splitlines()[0]


def _result(entry: JournalEntry, model: str, deltas: list[Delta]) -> BaseModel:
    """The whole reply: what the caller got (the first delta), then the continuation."""
    last = deltas[-1]
    totals = usage([last])
    if entry.route == "chat":
        message = reply_message(deltas)
        choice = p.ChatChoice(index=0, message=message, finish_reason=last.finish_reason, token_ids=token_ids(deltas))
        return p.ChatCompletionResponse(id=entry.request_id, created=entry.created, model=model, choices=[choice], usage=totals)
    choice = p.CompletionChoice(
        index=0, text="".join(d.text for d in deltas), finish_reason=last.finish_reason, token_ids=token_ids(deltas)
    )
    return p.CompletionResponse(id=entry.request_id, created=entry.created, model=model, choices=[choice], usage=totals)


REPLAYS = web.AppKey("paged_journal_replays", JournalReplays)


def add_routes(app: web.Application, replays: JournalReplays) -> None:
    """The routes that fetch a replayed request's result by its id."""
    app[REPLAYS] = replays
    if RESPONDER in app:  # NOTE: a journalled response is finished by the server's responder and stored there
        replays.responder = app[RESPONDER]
        app[REPLAYED] = replays.result
    app.router.add_get("/v1/chat/completions/{completion_id}", retrieve)
    app.router.add_get("/v1/completions/{completion_id}", retrieve)


async def retrieve(request: web.Request) -> web.Response:
    """A journalled request's whole result, once its replay finished (the handler waits for it).

    While the server starts, drains or restarts its engine the answer is a 503, which the SDK waits out: the
    replays have not started, or the result will be the next server's.
    """
    from integrations.openai_server.state import STATE, TENANT

    request.app[STATE].require_serving()
    completion_id = request.match_info["completion_id"]
    try:
        result = await request.app[REPLAYS].result(request[TENANT].name, completion_id)
    except PagedError as exc:
        raise from_sdk(exc, None) from None
    if result is None:
        raise ApiError(404, f"no journalled request {completion_id!r}", param="completion_id", code="not_found")
    return web.Response(text=result.model_dump_json(exclude_none=True), content_type="application/json")
