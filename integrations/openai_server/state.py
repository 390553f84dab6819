"""What the server's handlers share: the lifecycle phase, the serving glue, the tenants, in-flight requests.

The app (``create_app``) builds a ``ServerState`` and stores it under ``STATE``; the routes
and middlewares read it from there. Neither imports the other for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import hmac
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine.pooling.pooling_stats import merge_pooling

from integrations.openai_server.errors import RETRY_AFTER, ApiError, model_not_found
from integrations.openai_server.journal import RequestJournal
from integrations.openai_server.metrics import EngineCollector, ServerMetrics
from integrations.openai_server.policy import ANONYMOUS, ServerPolicy, Tenant, key_id
from integrations.openai_server.serving import Serving
from sdk.errors import EngineRestarting


DISCONNECT_POLL = 0.2  # seconds between checks that a handler's client is still connected


class Phase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    RESTARTING = "restarting"  # the engine's driver died; a fresh engine is starting
    DRAINING = "draining"
    DEAD = "dead"


_ENGINE_PHASES = {"running": Phase.SERVING, "restarting": Phase.RESTARTING}  # anything else: dead


@dataclass(eq=False)
class ServerState:
    """What the handlers share: the phase, the serving glue, the tenants and the in-flight registry."""

    policy: ServerPolicy  # the tenants, their keys (as digests) and terms
    drain_timeout: float
    phase: Phase = Phase.STARTING
    serving: Serving | None = None  # the main model's
    beside: dict[str, Serving] = field(default_factory=dict)  # the other models (chat, then pooling), by served name
    collector: EngineCollector = field(default_factory=EngineCollector)
    metrics: ServerMetrics = field(init=False)
    # request id -> (set when shutdown aborts it, its handler task)
    in_flight: dict[str, tuple[asyncio.Event, asyncio.Task]] = field(default_factory=dict)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    journal: RequestJournal | None = None  # with drain_journal: where a drain writes the requests it cuts off

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.collector)
        self.idle.set()
        self._digests = self.policy.key_table()
        self._tenants = {t.name: t for t in self.policy.tenants}

    def is_healthy(self) -> bool:
        """True while serving; follows the engine between serving and restarting, and into dead."""
        if self.phase in (Phase.SERVING, Phase.RESTARTING) and self.serving is not None:
            self.phase = _ENGINE_PHASES.get(self.serving.health().status, Phase.DEAD)
        return self.phase is Phase.SERVING

    def health(self) -> tuple[bool, dict[str, object]]:
        """Whether serving, and the ``/health`` body: the phase, the engine's restarts, what last killed its driver."""
        healthy = self.is_healthy()  # NOTE: first: it moves the phase along with the engine
        engine = self.serving.health() if self.serving is not None else None
        body = {
            "status": self.phase.value,
            "restarts": engine.restarts if engine is not None else 0,
            "last_error": engine.last_error if engine is not None else None,
        }
        return healthy, body

    def servings(self) -> list[Serving]:
        """Every model's serving glue: the main model's first."""
        return [s for s in (self.serving, *self.beside.values()) if s is not None]

    def stats(self) -> dict[str, dict[str, Any]]:
        """What ``/metrics`` exports, by chat model (the main one first): each engine's figures, and under the
        main model's ``pooling`` the pooling figures summed over every engine."""
        servings = self.servings()
        if not servings:
            return {}
        chat = [servings[0], *(s for s in servings[1:] if not s.is_pooling)]
        by_model = {s.model_name: dict(s.stats()) for s in chat}
        main = by_model[servings[0].model_name]
        # NOTE: the pooling figures go once, under the main model: the other chat engines' leave theirs
        pooling = [
            s.stats().get("pooling") if s.is_pooling else by_model[s.model_name].pop("pooling", None) for s in servings[1:]
        ]
        if "pooling" in main and any(pooling):
            main["pooling"] = merge_pooling(main["pooling"], *(p for p in pooling if p))
        return by_model

    def require_serving(
        self, model: str | None = None, *, tenant: Tenant | None = None, pooling: bool = False
    ) -> Serving:
        """The serving glue of the model a request names, or a 503 while starting, restarting, draining or dead.

        ``model`` None: the main model's (the first served), or on a ``pooling`` route the first pooling
        model's beside it, if any. A ``model`` no serving has, or one ``tenant`` may not use, is a 404
        ``model_not_found`` naming the field and the models the tenant may use.

        While the engine restarts, the code is the SDK's ``EngineRestarting`` one, so a remote SDK
        client retries it as it retries a request the restart cut short.
        """
        if not self.is_healthy() or self.serving is None:
            phase = self.phase
            raise ApiError(
                503,
                f"server is {phase.value}",
                code=EngineRestarting.code if phase is Phase.RESTARTING else f"server_{phase.value}",
                headers={"Retry-After": RETRY_AFTER},
            )
        if model is None:
            if pooling:
                return next((s for s in self.beside.values() if s.is_pooling), self.serving)
            return self.serving
        found = next((s for s in self.servings() if s.model_name == model), None)
        if found is None or (tenant is not None and not tenant.may_use_model(model)):
            served = [s.model_name for s in self.servings() if tenant is None or tenant.may_use_model(s.model_name)]
            raise model_not_found(model, served)
        return found

    def tenant_for(self, authorization: str | None) -> Tenant | None:
        """The tenant of a valid ``Authorization: Bearer <key>`` header; None when invalid."""
        if not self._digests:
            return self.policy.tenant(ANONYMOUS)
        token = ""
        if authorization and authorization[:7].lower() == "bearer ":
            token = authorization[7:].strip()
        presented = hashlib.sha256(token.encode()).hexdigest().encode()
        found = None
        # NOTE: compare against every key, so timing does not tell which key almost matched.
        for digest, name in self._digests.items():
            if hmac.compare_digest(presented, digest.encode()):
                found = name
        return None if found is None or not token else self._tenants[found]

    @contextlib.contextmanager
    def track(self, request_id: str, task: asyncio.Task) -> Iterator[asyncio.Event]:
        """Register an in-flight request; yields the event set when shutdown aborts it."""
        event = asyncio.Event()
        self.in_flight[request_id] = (event, task)
        self.idle.clear()
        try:
            yield event
        finally:
            del self.in_flight[request_id]
            if not self.in_flight:
                self.idle.set()


@contextlib.contextmanager
def cancel_on_disconnect(request: web.Request, task: asyncio.Task) -> Iterator[None]:
    """Cancel the handler ``task`` when its client goes away, whatever the runner's handler_cancellation."""

    async def watch() -> None:
        while (transport := request.transport) is not None and not transport.is_closing():
            await asyncio.sleep(DISCONNECT_POLL)
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        watcher.cancel()


STATE = web.AppKey("paged_state", ServerState)
TENANT = web.RequestKey("paged_tenant", Tenant)
SERVING = web.RequestKey("paged_serving", Serving)  # the model a request was routed to (its rate-limit headers')


def route_request(request: web.Request, model: str | None, pooling: bool = False) -> Serving:
    """``ServerState.require_serving`` for the request's tenant, noted on the request (``SERVING``)."""
    serving = request.app[STATE].require_serving(model, tenant=request[TENANT], pooling=pooling)
    request[SERVING] = serving
    return serving


def parse_keys(api_key: str | Sequence[str] | Mapping[str, str] | None) -> dict[str, str]:
    """``{tenant: key}`` from one key, several (tenants named by a short hash) or ``{tenant: key}``."""
    if api_key is None:
        return {}
    if isinstance(api_key, str):
        api_key = [api_key]
    pairs = dict(api_key) if isinstance(api_key, Mapping) else {key_id(key): key for key in api_key}
    if not all(pairs.values()):
        raise ValueError("api_key must not be empty")
    return pairs
