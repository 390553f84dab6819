"""A streamed answer that outlives its replica: the ingress relays whole events and goes on elsewhere when the replica dies.

The replica's server prefixes each event of a continuable stream with the relay's marker (the
tokens it carries; ``integrations.openai_server.relay``). ``RelayedEvents`` cuts the replica's
bytes into whole events, strips the markers and counts the tokens of the events passed on: what
the client received. When the replica dies, ``relay_events`` sends the request to another
replica as a ``Continuation`` of those tokens, and passes on that replica's events: the client's
stream goes on with the same chunk ``id``, no delta repeated or missing. A stream that cannot go
on (not continuable, its last token already sent, no attempt left) ends with the retryable
``replica_failed`` error event and ``[DONE]``, as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentResponseGenerator

from integrations.openai_server.errors import ApiError
from integrations.openai_server.relay import MARKER, Continuation, read_marker
from integrations.openai_server.sse import DONE, encode

logger = logging.getLogger(__name__)

REPLICA_FAULTS = (RayActorError, ActorUnavailableError)  # the replica died or cannot be reached
_END = b"\n\n"  # NOTE: an SSE event ends with a blank line; the server's JSON never holds a raw newline

Resend = Callable[[Continuation], DeploymentResponseGenerator]


class RelayedEvents:
    """The SSE bytes of one stream as whole events, markers stripped, and what the client received of them."""

    def __init__(self) -> None:
        self._buffer = b""
        self.token_ids: list[int] = []
        self.request_id: str | None = None  # the chunks' id, from the first marker
        self.created = 0
        self.final = False  # the completion's last token went out

    def feed(self, chunk: bytes) -> bytes:
        """The whole events ``chunk`` completes, without markers; their tokens count as received (send them)."""
        self._buffer += chunk
        end = self._buffer.rfind(_END)
        if end < 0:
            return b""
        whole, self._buffer = self._buffer[: end + len(_END)], self._buffer[end + len(_END) :]
        if MARKER not in whole:
            return whole  # NOTE: a stream that is not continuable, or its usage and [DONE]
        out = []
        for event in whole.split(_END)[:-1]:
            mark, event = read_marker(event)
            if mark is not None:
                self.request_id, self.created = mark.request_id, mark.created
                self.token_ids.extend(mark.token_ids)
                self.final = self.final or mark.final
            out.append(event + _END)
        return b"".join(out)

    def rest(self) -> bytes:
        """What followed the last whole event (nothing from a well-formed stream), passed on as it is."""
        rest, self._buffer = self._buffer, b""
        return rest

    def continuation(self) -> Continuation | None:
        """How the stream goes on elsewhere; None when it cannot (no marker: not continuable; or it ended)."""
        if self.request_id is None or self.final:
            return None
        self._buffer = b""  # NOTE: a partial event never reached the client: the continuation makes it again
        return Continuation(self.request_id, self.created, tuple(self.token_ids))


async def relay_events(
    first: bytes, stream: DeploymentResponseGenerator, resend: Resend, attempts_left: int
) -> AsyncIterator[bytes]:
    """The client's SSE bytes: ``stream``'s (``first`` its first chunk), then, each time its replica dies,
    those of ``resend(continuation)``, sent to up to ``attempts_left`` more replicas in all.

    Closing it (the client went away) cancels the replica's relay, which aborts the engine request.
    """
    events = RelayedEvents()
    pending = first
    try:
        while True:
            try:
                if out := events.feed(pending):
                    yield out
                async for chunk in stream:
                    if out := events.feed(chunk):
                        yield out
                if rest := events.rest():
                    yield rest
                return
            except REPLICA_FAULTS as exc:
                stream.cancel()
                continuation = events.continuation()
                logger.warning("replica failed mid-stream (%s): %s", "going on elsewhere" if continuation else "ended", exc)
            while continuation is not None and attempts_left > 0:
                attempts_left -= 1
                stream = resend(continuation)
                try:
                    pending = await _opening(stream)
                    break
                except REPLICA_FAULTS as exc:
                    stream.cancel()
                    logger.warning("replica failed before continuing a stream: %s", exc)
                except _Refused as refused:
                    yield refused.events
                    return
            else:
                yield _failed()
                return
    finally:
        stream.cancel()


class _Refused(Exception):
    """The replica answered a continuation with an error body; ``events`` passes it on and ends the stream."""

    def __init__(self, events: bytes) -> None:
        super().__init__()
        self.events = events


async def _opening(stream: DeploymentResponseGenerator) -> bytes:
    """The continued stream's first bytes.

    Raises:
        RayActorError, ActorUnavailableError: the replica died before it answered.
        _Refused: the replica answered with an error body (the continuation is refused, or it is overloaded).
    """
    head = await anext(stream)
    if head.is_event_stream:
        return await anext(stream, b"")
    body = b"".join([chunk async for chunk in stream])
    logger.warning("a replica refused to continue a stream (%d): %s", head.status, body[:200])
    try:
        error = json.dumps(json.loads(body), separators=(",", ":")).encode()
    except ValueError:
        raise _Refused(_failed()) from None
    raise _Refused(b"data: " + error + _END + DONE)


def _failed() -> bytes:
    error = ApiError(503, "the replica serving this stream failed; retry the request", code="replica_failed")
    return encode(error.body()) + DONE
