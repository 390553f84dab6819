"""The fleet's relay terms: what a server tells the ingress of a stream it serves, and how a stream goes on elsewhere.

A server behind the fleet's ingress (``integrations.ray``) holds a ``FleetRelay`` under
``RELAY``. A request whose ``X-Paged-Relay`` header carries the relay's secret comes from the
ingress through this replica (clients never see the secret: it lives in the replica's process).
For such a request, a continuable stream (one completion of one prompt, streamed, without tools,
logprobs or a parsed reasoning) prefixes each event with an SSE comment line, ``marker()``:
the chunk's ``id``, ``created``, the output token ids the event carries and whether it is the
completion's last. The ingress strips that line (``read_marker``) before the bytes go on, so the
client gets what a lone server sends.

When the replica dies mid-stream, the ingress sends the request to another replica with a
``Continuation``: the id and creation time of the chunks, and the tokens the client received.
The replica hands it to its server in process (``offer``: the header names a one-shot key, never
the tokens), and the route runs the request as a continuation of those tokens
(``AsyncClient.stream(resume_token_ids=...)``, the path the drain journal replays by).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from aiohttp import web

RELAY_HEADER = "X-Paged-Relay"  # the relay's secret: the request comes from the fleet's ingress
CONTINUE_HEADER = "X-Paged-Relay-Continue"  # the key of a continuation offered in process
MARKER = b": paged-relay "  # how a marker line starts


@dataclass(frozen=True, slots=True)
class Continuation:
    """A stream to go on with: its chunks' ``id`` and ``created``, and the output tokens its client received."""

    request_id: str
    created: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Marker:
    """What one relayed event carried: the chunk's id and creation time, its output tokens, and whether it ended the completion."""

    request_id: str
    created: int
    token_ids: tuple[int, ...]
    final: bool


class FleetRelay:
    """A replica's side of the relay: its secret, and the continuations offered to its server.

    Args:
        secret: the value of ``RELAY_HEADER`` that marks a request as the ingress's; a random one by default.
    """

    def __init__(self, secret: str | None = None) -> None:
        self.secret = secret or secrets.token_hex(16)
        self._offered: dict[str, Continuation] = {}

    def headers(self, continuation: Continuation | None = None) -> tuple[tuple[str, str], ...]:
        """The headers that mark a relayed request (and offer ``continuation``); ``discard`` the key after the request."""
        if continuation is None:
            return ((RELAY_HEADER, self.secret),)
        key = secrets.token_hex(16)
        self._offered[key] = continuation
        return (RELAY_HEADER, self.secret), (CONTINUE_HEADER, key)

    def discard(self, headers: tuple[tuple[str, str], ...]) -> None:
        """Forgets the continuation ``headers`` offered, if the server did not take it."""
        for name, value in headers:
            if name == CONTINUE_HEADER:
                self._offered.pop(value, None)

    def is_relayed(self, request: web.Request) -> bool:
        return secrets.compare_digest(request.headers.get(RELAY_HEADER, ""), self.secret)

    def take(self, request: web.Request) -> Continuation | None:
        """The continuation a relayed ``request`` names (once); None when it names none.

        Raises:
            KeyError: it names a key that was not offered, or was taken already.
        """
        key = request.headers.get(CONTINUE_HEADER)
        if key is None or not self.is_relayed(request):
            return None
        return self._offered.pop(key)


RELAY = web.AppKey("paged_fleet_relay", FleetRelay)


def marker(request_id: str, created: int, token_ids: list[int], final: bool) -> bytes:
    """The comment line that leads a relayed event (``: paged-relay {json}``)."""
    data = {"id": request_id, "created": created, "token_ids": token_ids, "final": final}
    return MARKER + json.dumps(data, separators=(",", ":")).encode() + b"\n"


def read_marker(event: bytes) -> tuple[Marker | None, bytes]:
    """An SSE event's marker, and the event without it (as it was when it has none).

    Raises:
        ValueError: a marker line that is not one ``marker()`` writes.
    """
    if not event.startswith(MARKER):
        return None, event
    line, _, rest = event.partition(b"\n")
    data = json.loads(line[len(MARKER) :])
    token_ids = data["token_ids"]
    if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
        raise ValueError("paged-relay marker: token_ids must be a list of ints")
    return Marker(str(data["id"]), int(data["created"]), tuple(token_ids), bool(data["final"])), rest
