"""The ingress's SSE handling of a relayed stream, without a cluster: markers stripped, tokens counted, continuations built.

Stand-in replica streams yield what ``EngineReplica.forward`` yields (a ``ResponseHead``, then
bytes) and raise Ray's actor errors where a replica dies. Skipped without the ``ray`` extra.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError  # noqa: E402

from integrations.openai_server.relay import Continuation, marker  # noqa: E402
from integrations.ray.failover import RelayedEvents, relay_events  # noqa: E402
from integrations.ray.replica import ResponseHead  # noqa: E402

ID, CREATED = "chatcmpl-abc", 1700000000
SSE_HEAD = ResponseHead(200, (("Content-Type", "text/event-stream"),))
JSON_HEAD = ResponseHead(400, (("Content-Type", "application/json"),))
DONE = b"data: [DONE]\n\n"


def _event(text: str, token_ids: list[int] | None, final: bool = False) -> bytes:
    """A chunk as the server writes it; with ``token_ids`` (not None) it carries the relay's marker."""
    data = {"id": ID, "created": CREATED, "choices": [{"index": 0, "delta": {"content": text}}]}
    event = b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
    return event if token_ids is None else marker(ID, CREATED, token_ids, final) + event


def _stripped(event: bytes) -> bytes:
    return event.partition(b"\n")[2] if event.startswith(b": paged-relay") else event


class StandInStream:
    """A replica's answer: ``items`` in order, then Ray's actor error if ``dies``; records ``cancel()``."""

    def __init__(self, items: Sequence[object], dies: bool = False) -> None:
        self._items = list(items)
        self._dies = dies
        self.cancelled = False

    def __aiter__(self) -> StandInStream:
        return self

    async def __anext__(self) -> object:
        if self._items:
            return self._items.pop(0)
        if self._dies:
            raise ActorDiedError()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


async def _collect(events) -> bytes:
    return b"".join([chunk async for chunk in events])


def test_whole_events_pass_without_markers_however_the_bytes_are_cut():
    """Fed a byte at a time, the events come out whole and unmarked, and their tokens are counted in order."""
    sent = [_event("", []), _event("Hel", [5]), _event("lo", [6, 7]), _event("", [8], final=True), DONE]
    stream = b"".join(sent)
    events = RelayedEvents()
    out = b"".join(events.feed(stream[i : i + 1]) for i in range(len(stream)))
    assert out == b"".join(_stripped(e) for e in sent)
    assert b"paged-relay" not in out and events.token_ids == [5, 6, 7, 8] and events.final
    assert events.continuation() is None  # its last token went out: nothing to go on with


def test_a_partial_event_is_held_and_the_continuation_names_what_went_out():
    """Only whole events go out; the continuation carries their tokens, the chunks' id and creation time."""
    events = RelayedEvents()
    assert events.feed(_event("a", [1]) + _event("b", [2])[:-5]) == _stripped(_event("a", [1]))
    assert events.continuation() == Continuation(ID, CREATED, (1,))


async def test_a_replica_dying_mid_stream_is_continued_on_another_with_the_received_tokens():
    """The client gets the first replica's events, then the second's, with no error and no marker."""
    first = [_event("", []), _event("One", [11]), _event(" two", [12]) + _event(" thr", [13])[:9]]
    dying = StandInStream(first[1:], dies=True)
    rest = [_event(" three", [13]), _event("", [2], final=True), DONE]
    sent: list[Continuation] = []
    successor = StandInStream([SSE_HEAD, *rest])

    def resend(continuation: Continuation) -> StandInStream:
        sent.append(continuation)
        return successor

    out = await _collect(relay_events(first[0], dying, resend, attempts_left=2))
    assert sent == [Continuation(ID, CREATED, (11, 12))]
    expected = [_event("", []), _event("One", [11]), _event(" two", [12]), *rest]
    assert out == b"".join(_stripped(e) for e in expected)
    assert dying.cancelled and successor.cancelled


async def test_a_continuation_whose_replica_dies_too_goes_on_from_all_the_tokens_sent():
    """Two deaths: each continuation carries every token the client got, from both replicas before it."""
    sent: list[Continuation] = []
    streams = [
        StandInStream([SSE_HEAD, _event(" two", [12])], dies=True),
        StandInStream([SSE_HEAD, _event(" three", [13], final=True), DONE]),
    ]

    def resend(continuation: Continuation) -> StandInStream:
        sent.append(continuation)
        return streams[len(sent) - 1]

    out = await _collect(relay_events(_event("One", [11]), StandInStream([], dies=True), resend, attempts_left=2))
    assert [c.token_ids for c in sent] == [(11,), (11, 12)]
    assert out == b"".join(_stripped(e) for e in [_event("One", [11]), _event(" two", [12]), _event(" three", [13]), DONE])


async def test_streams_that_cannot_go_on_end_with_replica_failed():
    """No marker (not continuable), the last token sent, or no attempt left: the retryable error event, then [DONE]."""
    unmarked = await _collect(relay_events(_event("a", None), StandInStream([], dies=True), _no_resend, 2))
    assert unmarked.startswith(_event("a", None)) and _error_code(unmarked) == "replica_failed"
    ended = await _collect(relay_events(_event("a", [1], final=True), StandInStream([], dies=True), _no_resend, 2))
    assert _error_code(ended) == "replica_failed"
    resent: list[StandInStream] = []

    def dead_on_arrival(continuation: Continuation) -> StandInStream:
        resent.append(StandInStream([], dies=True))
        return resent[-1]

    exhausted = await _collect(relay_events(_event("a", [1]), StandInStream([], dies=True), dead_on_arrival, 2))
    assert len(resent) == 2 and all(s.cancelled for s in resent) and _error_code(exhausted) == "replica_failed"


async def test_a_refused_continuation_passes_the_replicas_error_on():
    """A replica that answers the continuation with an error body: that error as an event, then [DONE]."""
    body = json.dumps({"error": {"message": "busy", "type": "rate_limit_error", "code": "overloaded"}}).encode()
    refusing = StandInStream([JSON_HEAD, body])
    out = await _collect(relay_events(_event("a", [1]), StandInStream([], dies=True), lambda c: refusing, 2))
    assert _error_code(out) == "overloaded" and out.endswith(DONE)


def _no_resend(continuation: Continuation) -> StandInStream:
    raise AssertionError(f"nothing to continue, yet resent {continuation}")


def _error_code(out: bytes) -> str:
    *_, error, done, _ = out.split(b"\n\n")
    assert done == b"data: [DONE]"
    return json.loads(error.removeprefix(b"data: "))["error"]["code"]
