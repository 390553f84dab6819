"""The aiohttp application: ``create_app()`` wires auth, errors, routes and the engine's lifetime.

Lifecycle::

    starting --(engine loaded)--> serving --(shutdown: SIGTERM)--> draining --> stopped
         \\--(load failed)--> dead    |   ^
                     (driver died)  v   |  (a fresh engine serves)
                                 restarting --(crash loop)--> dead

``/health`` answers 200 only while serving; its body also counts the engine's restarts and
names the error that last killed its driver. While restarting, requests get 503
``engine_restarting`` with ``Retry-After`` (the SDK retries it). On shutdown the server stops admitting (503),
lets in-flight requests finish for ``drain_timeout`` seconds, then aborts the rest (with
``drain_journal``, writes them to the journal first: ``journal``); every request still gets a
terminal answer (an error body, or a final SSE event and ``[DONE]``). The engine's KV prefixes
and the stored responses are saved under ``kv_cache_dir`` as the app closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

from aiohttp import web

from engine.errors import ParameterError
from engine.model_info import model_name
from engine.supervisor import RestartPolicy
from integrations.openai_server import journal_replay, pooling_routes, responses_api, routes, vllm_routes
from integrations.openai_server.errors import ApiError, error_middleware
from integrations.openai_server.journal import RequestJournal
from integrations.openai_server.journal_replay import JournalReplays
from integrations.openai_server.policy import ROUTES, ServerPolicy, route_of
from integrations.openai_server.wire_pieces import rate_limit_headers
from integrations.openai_server.serving import Serving
from integrations.openai_server.state import SERVING, STATE, TENANT, Phase, ServerState, parse_keys
from sdk.images import ImageLimits
from sdk.responses.config import ResponsesConfig

logger = logging.getLogger(__name__)

DEFAULT_CLIENT_MAX_SIZE = 4 << 20  # bytes of request body
DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds


def create_app(
    model: str | Sequence[str] | None = None,
    *,
    api_key: str | Sequence[str] | Mapping[str, str] | None = None,
    policy: ServerPolicy | None = None,
    served_model_name: str | Sequence[str] | None = None,
    hooks: Sequence[Any] = (),
    client_max_size: int = DEFAULT_CLIENT_MAX_SIZE,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    serving_factory: Callable[[], Serving] | None = None,
    restart: RestartPolicy | None = None,
    reasoning_parser: str = "auto",
    image_limits: ImageLimits | None = None,
    responses: ResponsesConfig | None = None,
    pooling_models: Sequence[str] = (),
    drain_journal: bool = False,
    **engine_config: Any,
) -> web.Application:
    """Build the OpenAI-compatible application; the engine starts with the app and stops with it.

    Args:
        model: HF directory or ``.gguf`` path; None serves the bundled SmolLM2. Several (a list) serve
            several chat models, each its own engine with ``engine_config``: a request goes to the model its
            ``model`` names, one without it to the first; every engine of the process steps in turn
            (``engine.driver.STEP_LOCK``), so they share the cores without contending for them.
        api_key: one key, several, or ``{tenant_name: key}``; these keys get the policy's
            default terms. Tenants (what the SDK hooks and audit see) are the names, or a
            short hash of each key. With no key here nor in ``policy``, auth is off.
        policy: the tenants, their keys and terms (``ServerPolicy``, or ``ServerPolicy.load``
            of a policy file); None = every key on ``TenantPolicy()``'s terms.
        served_model_name: the ``model`` id clients use; defaults to the engine's model name. With several
            models, one name per model in their order (or None: each its own name).
        hooks: SDK hooks run on every request (``sdk.hooks.Hook`` instances).
        client_max_size: largest accepted request body in bytes (larger ones get 413).
        drain_timeout: seconds in-flight requests get to finish on shutdown before abort.
        serving_factory: builds the serving glue (tests inject one over a prepared engine);
            by default an in-process engine is built from ``model`` and ``engine_config``.
        restart: how that engine replaces a driver that died (``engine.supervisor.RestartPolicy``);
            None = the default policy.
        reasoning_parser: how chat replies' reasoning is split from their content, sent as
            ``reasoning_content``: ``"auto"`` (from the chat template), ``"none"`` or a family
            (``sdk.reasoning.REASONING_PARSERS``).
        image_limits: what a request's images may be (count, bytes, pixels, remote hosts);
            None = ``sdk.images.ImageLimits()``: no remote URLs.
        responses: the bounds of the stored responses and of their conversations' pins
            (``sdk.responses.ResponsesConfig``); the store is kept under ``kv_cache_dir`` when set.
        pooling_models: pooling models (embedders, rerankers: HF directories) served beside ``model``,
            each under its directory's name; a request goes to the model its ``model`` names, and a
            pooling route without one to the first of these. Their engines take ``dtype`` and ``device``
            from ``engine_config``; every engine of the process steps in turn (``engine.driver``).
        drain_journal: at the drain's deadline, write the chat and completion requests still running
            to ``<kv_cache_dir>/journal`` (their callers get 503 ``request_journalled`` naming the id) instead
            of only aborting them; at start, finish the journal's requests and keep their results by id
            (``journal_replay``). Needs ``kv_cache_dir``.
        **engine_config: ``EngineConfig`` fields (block_size, num_blocks, max_num_seqs, ...).

    Returns:
        The application; run it with ``web.run_app`` or an ``AppRunner``.

    Raises:
        ParameterError: ``drain_journal`` without ``kv_cache_dir``, a ``served_model_name`` list whose length is
            not the models', or two models served under one name (``param`` names the field).
    """
    chat_models = _chat_models(model, served_model_name)
    _check_names([name for _, name in chat_models] + [model_name(path) for path in pooling_models])
    sized = any(engine_config.get(k) is not None for k in ("kv_cache_memory", "num_blocks"))
    if len(chat_models) > 1 and not sized and engine_config.get("device", "auto") != "cpu":
        logger.warning(
            "%d chat models without kv_cache_memory: on a GPU each engine's KV cache takes a share of the memory "
            "free as it loads, so the first takes the most; give kv_cache_memory (each engine's) to split it",
            len(chat_models),
        )
    state = ServerState(policy=(policy or ServerPolicy()).with_keys(parse_keys(api_key)), drain_timeout=drain_timeout)
    kv_cache_dir = engine_config.get("kv_cache_dir")
    replays = None
    if drain_journal:
        if kv_cache_dir is None:
            raise ParameterError("drain_journal", "drain_journal needs kv_cache_dir: the journal is kept there")
        state.journal = RequestJournal(Path(kv_cache_dir) / "journal")
        replays = JournalReplays(state.journal)
    app = web.Application(
        client_max_size=client_max_size,
        middlewares=[_count_middleware, error_middleware, _auth_middleware],
    )
    app[STATE] = state
    app.on_response_prepare.append(_add_rate_limit_headers)
    routes.add_routes(app)
    responses_api.add_routes(app, responses, kv_cache_dir)
    if replays is not None:
        journal_replay.add_routes(app, replays)
    vllm_routes.add_routes(app)
    pooling_routes.add_routes(app)

    chat = [
        functools.partial(
            Serving.create, path, served_model_name=name, hooks=hooks, restart=restart,
            reasoning_parser=reasoning_parser, image_limits=image_limits, **engine_config,
        )  # fmt: skip
        for path, name in chat_models
    ]
    factory = serving_factory or chat[0]
    shared = {k: v for k, v in engine_config.items() if k in ("dtype", "device")}
    pooling = [functools.partial(Serving.create, path, hooks=hooks, restart=restart, **shared) for path in pooling_models]

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        load = asyncio.create_task(_load(state, factory, chat[1:], pooling, replays))
        yield
        state.phase = Phase.DRAINING
        if not load.done():
            load.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await load
        if replays is not None:  # NOTE: before the engine closes: a replay cut short stays in the journal
            await replays.stop()
        for serving in state.servings():
            await serving.close()

    app.cleanup_ctx.append(engine_ctx)
    app.on_shutdown.append(_drain)
    return app


def _chat_models(model: Any, served_model_name: str | Sequence[str] | None) -> list[tuple[str | None, str]]:
    """``(path, served name)`` of each chat model ``create_app`` serves, in order.

    Raises:
        ParameterError: a list of served names whose length is not the models'.
    """
    one = model is None or isinstance(model, (str, PathLike))
    paths = [None if model is None else str(model)] if one else [str(m) for m in model]
    if not paths:
        raise ParameterError("model", "model: give at least one model (or None for the bundled one)")
    one_name = served_model_name is None or isinstance(served_model_name, str)
    names = [served_model_name] if one_name else list(served_model_name)
    if names == [None]:
        names = [None] * len(paths)
    if len(names) != len(paths):
        raise ParameterError(
            "served_model_name",
            f"served_model_name: {len(names)} names for {len(paths)} models; give one per model, in their order",
        )  # fmt: skip
    return [(path, name or model_name(path)) for path, name in zip(paths, names)]


def _check_names(names: Sequence[str]) -> None:
    """Each model's served name is its own: a request's ``model`` picks one.

    Raises:
        ParameterError: two models under one name.
    """
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ParameterError(
                "served_model_name", f"served_model_name: two models would be served as {name!r}; name them apart",
            )  # fmt: skip
        seen.add(name)


async def _load(
    state: ServerState, factory: Callable[[], Serving], chat: Sequence[Callable[[], Serving]] = (),
    pooling: Sequence[Callable[[], Serving]] = (), replays: JournalReplays | None = None,
) -> None:  # fmt: skip
    try:
        # NOTE: loading weights blocks; a thread keeps /health answering "starting" meanwhile.
        serving = await asyncio.to_thread(factory)
        await serving.start()
        # NOTE: every engine steps under engine.driver.STEP_LOCK, one step at a time with all of torch's
        # threads: the chat models beside the first take their turns as a pooling model does, and a pooling
        # model yields to them (share_steps): while they have requests, its turn is pooling_time_fraction of
        # their step, a layer of its batch at a time.
        for make in (*chat, *pooling):
            beside = await asyncio.to_thread(make)
            state.beside[beside.model_name] = beside
            await beside.start()
            if beside.is_pooling:
                await beside.engine.share_steps()
    except Exception:
        logger.exception("engine failed to start")
        state.phase = Phase.DEAD
        return
    # NOTE: the model, tokenizer and modules loaded so far live as long as the server: frozen, a full
    # collection no longer walks them, which would hold the loop for tens of milliseconds at a time.
    gc.collect()
    gc.freeze()
    state.serving = serving
    state.collector.bind_models(state.stats)
    if replays is not None:
        try:
            replays.start(state, [s for s in state.servings() if not s.is_pooling])
        except Exception:  # noqa: BLE001 - the journal is kept for the next start; this one serves
            logger.exception("journal: replaying %s failed", replays.journal.directory)
    if state.phase is Phase.STARTING:
        state.phase = Phase.SERVING
        logger.info("serving %s", ", ".join(s.model_name for s in state.servings()))


async def _drain(app: web.Application) -> None:
    """Stop admitting, wait for in-flight requests up to the drain timeout, then abort the rest (each handler
    writes its request to the journal first, when there is one)."""
    state = app[STATE]
    state.phase = Phase.DRAINING
    if not state.in_flight:
        return
    logger.info("draining %d in-flight requests", len(state.in_flight))
    try:
        await asyncio.wait_for(state.idle.wait(), state.drain_timeout)
        return
    except asyncio.TimeoutError:
        pass
    what = "journalling or aborting" if state.journal is not None else "aborting"
    logger.warning("drain timeout: %s %d requests", what, len(state.in_flight))
    for event, task in list(state.in_flight.values()):
        # NOTE: the handler sees the event, aborts its engine request and answers 503 / a final event.
        event.set()
        task.cancel()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(state.idle.wait(), 5.0)


_PUBLIC = frozenset({"/health"})


@web.middleware
async def _count_middleware(request: web.Request, handler) -> web.StreamResponse:
    response = await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    request.app[STATE].metrics.http_requests.labels(route, str(response.status)).inc()
    return response


@web.middleware
async def _auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    if request.path not in _PUBLIC:
        tenant = state.tenant_for(request.headers.get("Authorization"))
        if tenant is None:
            raise ApiError(
                401, "missing or invalid API key", code="invalid_api_key"
            )
        route = route_of(request.path)
        if route in ROUTES and not tenant.may_use_route(route):
            raise ApiError(403, f"this key may not use {route}", code="route_not_allowed")
        request[TENANT] = tenant
    return await handler(request)


async def _add_rate_limit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """OpenAI's ``x-ratelimit-*`` headers on every answer to a tenant with rate limits."""
    tenant = request.get(TENANT)
    serving = request.get(SERVING) or request.app[STATE].serving
    limiter = serving.limiter(tenant.name) if tenant is not None and serving is not None else None
    if limiter is not None:
        response.headers.update(rate_limit_headers(limiter.state()))
