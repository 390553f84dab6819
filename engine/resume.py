"""Requests that outlive their engine: what the driver keeps of each, and which ones a driver death resumes.

The driver records, for each request it streams, the request as it was queued and every
token its caller has received (``Received``). When the driver dies, ``Resumption`` sorts the
requests in flight: with resume on, an ``n == 1`` request is re-queued on the fresh engine as
a continuation of what its caller got (its prompt and received tokens, the prefix cache
making most of their KV free), and its stream goes on; the others end with the error of the
death. A request in flight at more than ``max_resumes`` deaths is a suspect: suspects run on
the fresh engines one at a time, and one in flight at a further death is failed with
``RequestPoisoned``, so a request that kills every engine it runs on does not take the
others with it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.commands import Channel
from engine.errors import EngineError, RequestPoisoned
from engine.outputs import Received
from engine.processor import ProcessedRequest


@dataclass(eq=False)
class InFlight:
    """A request the driver streams: its queued form, its channel and what the caller received."""

    request: ProcessedRequest
    channel: Channel
    received: Received = field(default_factory=Received)
    num_deaths: int = 0  # driver deaths it was in flight at
    suspect: bool = False  # in flight at more than max_resumes deaths: runs alone among suspects

    @property
    def request_id(self) -> str:
        assert self.request.request_id is not None  # NOTE: AsyncEngine names every request before queueing it
        return self.request.request_id


class Resumption:
    """The requests a driver death left to resume, in arrival order, and the suspects that wait their turn.

    Args:
        resume: resume requests at all (off: each ends with the death's error, as before).
        max_resumes: deaths a request may be in flight at and still be resumed with the others.
    """

    def __init__(self, resume: bool, max_resumes: int) -> None:
        self.resume = resume
        self.max_resumes = max_resumes
        self.pending: list[InFlight] = []  # to re-queue on the fresh engine
        self.suspects: deque[InFlight] = deque()  # to re-queue one at a time
        self.aborted: set[str] = set()  # aborted while no engine ran: re-queued, then aborted at once
        self.num_resumed = 0
        self.num_poisoned = 0

    def sort(self, flights: list[InFlight], error: Callable[[], EngineError]) -> None:
        """After a death: keeps each request in ``flights`` to resume, or answers it with its error."""
        for flight in flights:
            flight.num_deaths += 1
            if not self.resume or flight.request.params.n != 1:
                flight.channel.send(error())
            elif flight.suspect:
                self.num_poisoned += 1
                flight.channel.send(RequestPoisoned(flight.request_id, flight.num_deaths))
            elif flight.num_deaths > self.max_resumes:
                flight.suspect = True
                self.suspects.append(flight)
            else:
                self.pending.append(flight)

    def abort(self, request_id: str) -> bool:
        """Notes an abort of a kept request (re-queued, then aborted, so its stream ends as aborted); False: none."""
        for flight in self.suspects:
            if flight.request_id == request_id:
                self.suspects.remove(flight)
                self.pending.append(flight)
                break
        if any(flight.request_id == request_id for flight in self.pending):
            self.aborted.add(request_id)
            return True
        return False

    def take(self, suspect_running: bool) -> Iterator[InFlight]:
        """The requests to re-queue now: every pending one, and the next suspect unless one runs."""
        pending, self.pending = self.pending, []
        if not suspect_running and self.suspects:
            pending.append(self.suspects.popleft())
        self.num_resumed += len(pending)
        yield from pending

    def drop(self, error: Callable[[], EngineError]) -> None:
        """Answers every kept request with ``error()`` (the engine is dead or shut down)."""
        for flight in [*self.pending, *self.suspects]:
            flight.channel.send(error())
        self.pending.clear()
        self.suspects.clear()
        self.aborted.clear()

    def __bool__(self) -> bool:
        return bool(self.pending or self.suspects)
