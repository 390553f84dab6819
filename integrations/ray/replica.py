"""``EngineReplica``: one ``paged serve`` application (engine, SDK hooks, OpenAI routes) per Ray Serve replica.

The replica runs the same aiohttp application ``paged serve`` runs (``command.make_app``) on a
loopback port of its own and relays each request the ingress hands it to that port, so routes,
errors, keys, tenant policy, hooks, metrics and disconnect-aborts are the server's own. It yields a
``ResponseHead`` and then the body as it arrives (the SSE events of a streaming answer).

For the router it reports, every ``request_routing_stats_period_s``, which of the prefixes it was
sent are still cached in its engine, and how many requests its engine runs and queues.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from integrations.openai_server.relay import CONTINUE_HEADER, RELAY, RELAY_HEADER, Continuation, FleetRelay
from integrations.openai_server.state import STATE, Phase
from integrations.ray.router import STATS_PREFIXES, STATS_QUEUE

logger = logging.getLogger(__name__)

MAX_TRACKED_HASHES = 8192  # leading-block hashes a replica checks for its report (LRU)
START_POLL = 0.05  # seconds between checks that the engine has loaded
# NOTE: hop-by-hop headers and those the receiving side sets itself are not relayed; nor the relay's own, which
# only the replica sets (a client that sends them has them dropped).
_DROPPED_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "date", "server",
     RELAY_HEADER.lower(), CONTINUE_HEADER.lower()}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it."""

    method: str
    path: str  # with its query string
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The status and headers of the replica's answer; its body follows as bytes chunks."""

    status: int
    headers: tuple[tuple[str, str], ...]

    @property
    def is_event_stream(self) -> bool:
        return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in self.headers)


def relayed_headers(headers: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in headers if k.lower() not in _DROPPED_HEADERS)


class EngineReplica:
    """A Ray Serve deployment class: ``paged serve`` for ``args`` on a loopback port, relayed.

    Args:
        args: the ``paged serve`` flags (``argparse.Namespace``); ``--audit-log PATH`` becomes
            ``PATH.<replica id>``, one append-only log per replica.
        make_app: builds the server's application from the flags (``command.make_app``).
    """

    async def __init__(self, args: argparse.Namespace, make_app: Callable[[argparse.Namespace], web.Application]) -> None:
        from ray import serve

        replica_id = serve.get_replica_context().replica_id.unique_id
        if args.audit_log:
            args = argparse.Namespace(**{**vars(args), "audit_log": f"{args.audit_log}.{replica_id}"})
        self._app = make_app(args)
        self._relay = self._app[RELAY] = FleetRelay()
        self._runner = web.AppRunner(self._app, handler_cancellation=True, shutdown_timeout=args.drain_timeout + 10.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self._session = aiohttp.ClientSession(
            f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        self._prefixes: OrderedDict[bytes, None] = OrderedDict()
        state = self._app[STATE]
        while state.phase is Phase.STARTING:
            await asyncio.sleep(START_POLL)
        if state.phase is not Phase.SERVING:
            raise RuntimeError("the engine failed to start; see the replica's log")

    async def forward(
        self, request: ForwardedRequest, prefix: Sequence[bytes] = (), replica: str | None = None,
        continuation: Continuation | None = None,
    ) -> AsyncIterator[Any]:  # fmt: skip
        """Relays ``request`` to this replica's server: yields a ``ResponseHead``, then body chunks.

        ``prefix`` (the request's leading block hashes) and ``replica`` (set when the request is
        for this replica alone) are what the router routed by. The replica remembers the hashes
        to report which ones its engine still caches. The request goes with the relay's headers
        (``integrations.openai_server.relay``): a continuable stream's events carry their tokens,
        and ``continuation`` makes it go on from what its client received on a replica that died.
        """
        for digest in prefix:
            self._prefixes[digest] = None
            self._prefixes.move_to_end(digest)
        while len(self._prefixes) > MAX_TRACKED_HASHES:
            self._prefixes.popitem(last=False)
        relay = self._relay.headers(continuation)
        try:
            async with self._session.request(
                request.method, request.path, headers=relayed_headers(request.headers) + relay, data=request.body
            ) as response:
                yield ResponseHead(response.status, relayed_headers(tuple(response.headers.items())))
                async for chunk in response.content.iter_any():
                    yield chunk
        finally:
            self._relay.discard(relay)

    async def record_routing_stats(self) -> dict[str, Any]:
        """The tracked prefixes the engine still caches (hashes), and its running + waiting requests."""
        serving = self._app[STATE].serving
        if serving is None:
            return {STATS_PREFIXES: frozenset(), STATS_QUEUE: 0}
        tracked = list(self._prefixes)

        def cached(engine: Any) -> frozenset[bytes]:
            pool = engine.kv.block_pool
            return frozenset(h for h in tracked if pool.get_cached_block(h) is not None)

        stats = serving.stats()
        held = await serving.engine.call(cached) if tracked else frozenset()
        return {
            STATS_PREFIXES: held,
            STATS_QUEUE: int(stats.get("num_requests_running", 0)) + int(stats.get("num_requests_waiting", 0)),
        }

    async def check_health(self) -> None:
        """Raises when the engine is not serving; Ray Serve then replaces the replica."""
        state = self._app[STATE]
        if not state.is_healthy():
            raise RuntimeError(f"the replica's server is {state.phase.value}")

    async def __del__(self) -> None:
        with contextlib.suppress(Exception):
            await self._session.close()
            await self._runner.cleanup()
