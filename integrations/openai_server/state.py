"""What the server's handlers share: the lifecycle phase, the serving glue, API keys, in-flight requests.

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

from aiohttp import web

from integrations.openai_server.metrics import EngineCollector, ServerMetrics
from integrations.openai_server.serving import Serving


class Phase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    DEAD = "dead"


@dataclass(eq=False)
class ServerState:
    """What the handlers share: the phase, the serving glue, API keys and the in-flight registry."""

    api_keys: dict[str, str]  # key -> tenant id (a configured name or a short hash, never the key)
    drain_timeout: float
    phase: Phase = Phase.STARTING
    serving: Serving | None = None
    collector: EngineCollector = field(default_factory=EngineCollector)
    metrics: ServerMetrics = field(init=False)
    # request id -> (set when shutdown aborts it, its handler task)
    in_flight: dict[str, tuple[asyncio.Event, asyncio.Task]] = field(default_factory=dict)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.collector)
        self.idle.set()

    def is_healthy(self) -> bool:
        if self.phase is Phase.SERVING and self.serving is not None and not self.serving.is_running():
            self.phase = Phase.DEAD
        return self.phase is Phase.SERVING

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant id of a valid ``Authorization: Bearer <key>`` header; None when invalid."""
        if not self.api_keys:
            return "anonymous"
        token = ""
        if authorization and authorization[:7].lower() == "bearer ":
            token = authorization[7:].strip()
        found = None
        # NOTE: compare against every key, so timing does not tell which key almost matched.
        for key, tenant in self.api_keys.items():
            if hmac.compare_digest(token.encode(), key.encode()):
                found = tenant
        return found

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


STATE = web.AppKey("paged_state", ServerState)
TENANT = web.RequestKey("paged_tenant", str)


def key_id(key: str) -> str:
    """A tenant id for an unnamed API key: a short hash, safe to log and audit."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_keys(api_key: str | Sequence[str] | Mapping[str, str] | None) -> dict[str, str]:
    if api_key is None:
        return {}
    if isinstance(api_key, str):
        api_key = [api_key]
    if isinstance(api_key, Mapping):
        pairs = [(key, name) for name, key in api_key.items()]
    else:
        pairs = [(key, key_id(key)) for key in api_key]
    keys = {}
    for key, tenant in pairs:
        if not key:
            raise ValueError("api_key must not be empty")
        keys[key] = tenant
    return keys
