"""The driver loop: one ``Engine`` stepped between the commands of the inbox, each step's deltas sent to their channels.

The driver thread drains the inbox between steps, steps while there is work and sleeps on
the inbox when there is none. It is the only code that touches the ``Engine`` it drives. It
records what each request's caller has received, so that after a driver death a fresh engine
can resume the request (``engine.resume``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.admission import Admission
from engine.chat_pace import CHAT_PACE
from engine.commands import Abort, Add, Call, Command, Pin, Stop, posted_to, public_pin_id, refuse, resolve
from engine.errors import EngineError
from engine.outputs import Delta, PinnedPrefix, Received
from engine.resume import InFlight, Resumption

if TYPE_CHECKING:
    from engine.llm_engine import Engine


class TurnLock:
    """A lock handed to its waiters in the order they came: a driver that just stepped queues behind one that
    waits, so no engine steps twice while another waits for its turn."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._issued = 0  # tickets handed out
        self._serving = 0  # the ticket whose turn it is

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._issued
            self._issued += 1
            while ticket != self._serving:
                self._cond.wait()

    def __exit__(self, *exc_info: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


STEP_LOCK = TurnLock()
"""Held through each step by every driver of the process: engines served side by side (a chat model and an
embedder) step in turn, each step with all of torch's intra-op threads, never two steps contending for the cores."""


class Driver:
    """Runs the inbox's commands on an ``Engine`` and steps it; driver thread only.

    It outlives the engines it drives: after one dies, ``suspend`` keeps the requests to resume
    (``resumption``) and answers the rest, ``fail`` answers the pins and queued commands it leaves
    behind, and ``resume`` re-queues the kept requests on the fresh engine the next ``drive`` takes.

    Args:
        inbox: the commands callers post.
        admission: released as each request leaves the waiting queue.
        publish: called with the engine after each step (and when it idles), before outputs go out.
        stale: the error for a command posted to an engine that is gone.
        resumption: which requests a death resumes.
    """

    def __init__(
        self,
        inbox: queue.SimpleQueue[Command],
        admission: Admission,
        publish: Callable[[Engine], None],
        stale: Callable[[], EngineError],
        resumption: Resumption,
    ) -> None:
        self.inbox = inbox
        self._admission = admission
        self._publish = publish
        self._stale = stale
        self.resumption = resumption
        self._flights: dict[str, InFlight] = {}  # requests in the engine
        self._pins: dict[str, Pin] = {}  # pins still computing

    def drive(self, engine: Engine, generation: int) -> None:
        """Steps ``engine`` while there is work, between the commands of the inbox; returns on ``Stop``.

        Raises:
            BaseException: whatever killed the drive (a fault outside the per-step isolation).
        """
        # NOTE: a chat engine tells the pooling engines beside it whether it has requests (before it queues for its
        # turn, so that a pooling batch in progress yields after its current layer) and how long its steps take
        pace = CHAT_PACE if engine.pooling is None else None
        fraction = engine.config.pooling_time_fraction
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                if idle and pace is not None:
                    pace.set_active(id(self), False, fraction)
                commands = [self.inbox.get()] if idle else []
                while True:
                    try:
                        commands.append(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if isinstance(command, Stop):
                        engine.abort_request(list(self._flights))
                        self._emit(generation, engine.pop_deltas(), {})
                        return
                    self._handle(engine, generation, command)
                active = pace is not None and engine.has_unfinished_requests()
                if active:
                    pace.set_active(id(self), True, fraction)
                with STEP_LOCK:
                    started = time.perf_counter()
                    deltas = engine.step_deltas()
                    elapsed = time.perf_counter() - started
                if active:
                    pace.observe(id(self), elapsed)
                failures = engine.pop_failures()
                self._publish(engine)
                self._emit(generation, deltas, failures)
                if self.resumption.suspects:  # NOTE: the next suspect runs once the one before has left
                    self.resume(engine, generation)
        finally:
            if pace is not None:
                pace.forget(id(self))

    def unpin(self, engine: Engine, pin_id: str) -> None:
        """Releases ``engine``'s pin ``pin_id``; one still computing fails its waiter."""
        engine.unpin_prefix(pin_id)
        waiter = self._pins.pop(pin_id, None)
        if waiter is not None:  # unpinned before it finished computing
            resolve(waiter.loop, waiter.future, error=EngineError(f"prefix {pin_id} was unpinned while pinning"))

    def suspend(self, error: Callable[[], EngineError]) -> None:
        """After a death: keeps the requests in flight that a fresh engine resumes; answers the others with ``error()``."""
        flights = list(self._flights.values())
        self._flights.clear()
        self.resumption.sort(flights, error)

    def resume(self, engine: Engine, generation: int) -> None:
        """Re-queues the kept requests on ``engine`` (of ``generation``) as continuations of what their callers got."""
        resumption = self.resumption
        suspect_running = any(flight.suspect for flight in self._flights.values())
        for flight in resumption.take(suspect_running):
            flight.channel.generation = generation
            try:
                request_id = engine.enqueue(flight.request, flight.received)
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                flight.channel.send(exc)
                continue
            self._flights[request_id] = flight
            if request_id in resumption.aborted:
                resumption.aborted.discard(request_id)
                engine.abort_request(request_id)
                self._emit(generation, engine.pop_deltas(), {})

    def fail(self, error: Callable[[], EngineError]) -> None:
        """Answers every request (kept ones included), pin and queued command of an engine that is gone with ``error()``."""
        for flight in self._flights.values():
            flight.channel.send(error())
        self._flights.clear()
        self.resumption.drop(error)
        self.fail_pins(error)

    def fail_pins(self, error: Callable[[], EngineError]) -> None:
        """Answers the pins and the queued commands of an engine that is gone with ``error()``; kept requests stay."""
        for pin in self._pins.values():
            resolve(pin.loop, pin.future, error=error())
        self._pins.clear()
        while True:  # NOTE: commands posted before the failure was visible are answered here
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
            self.refuse(command, error())

    def refuse(self, command: Command, error: EngineError) -> None:
        """Answers a command posted while no engine serves; an abort of a kept request is noted for its resume."""
        if isinstance(command, Abort):
            self.resumption.abort(command.request_id)
        refuse(command, error)

    def _handle(self, engine: Engine, generation: int, command: Command) -> None:
        if posted_to(command, generation) != generation:  # NOTE: posted to an engine that died: never run on this one
            refuse(command, self._stale())
            return
        if isinstance(command, Add):
            try:
                request_id = engine.enqueue(command.request, command.received)
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                command.channel.send(exc)
                return
            command.channel.accepted = True
            # NOTE: a continuation's received tokens are part of what a resume after a death goes on from
            received = Received(list(command.received.token_ids)) if command.received is not None else Received()
            self._flights[request_id] = InFlight(command.request, command.channel, received)
        elif isinstance(command, Abort):
            if command.request_id in self._pins:
                self.unpin(engine, command.request_id)
                return
            if self.resumption.abort(command.request_id):  # a suspect waiting its turn: queued to be aborted
                self.resume(engine, generation)
                return
            engine.abort_request(command.request_id)
            # NOTE: sent now, before a later command may reuse the id
            self._emit(generation, engine.pop_deltas(), {})
        elif isinstance(command, Pin):
            try:
                pin_id = engine.enqueue(command.request)
            except Exception as exc:  # noqa: BLE001
                resolve(command.loop, command.future, error=exc)
                return
            self._pins[pin_id] = command
        elif isinstance(command, Call):
            try:
                result = command.fn(engine)
            except Exception as exc:  # noqa: BLE001
                resolve(command.loop, command.future, error=exc)
                return
            resolve(command.loop, command.future, result)

    def _emit(self, generation: int, deltas: list[Delta], failures: dict[str, EngineError]) -> None:
        """Sends each request's deltas (consecutive in ``deltas``) to its channel, or settles its pin."""
        start = 0
        for end, delta in enumerate(deltas, 1):
            # NOTE: a request's deltas end at the one with usage: should an aborted request's id
            # be reused before its last delta is sent, the two requests' deltas stay apart.
            if end < len(deltas) and deltas[end].request_id == delta.request_id and delta.usage is None:
                continue
            request_id, usage, group, start = delta.request_id, delta.usage, deltas[start:end], end
            if request_id in self._pins:
                if usage is not None:
                    pin = self._pins.pop(request_id)
                    result = PinnedPrefix(public_pin_id(request_id, generation), len(pin.request.prompt_token_ids), usage.cached_tokens)
                    resolve(pin.loop, pin.future, result, failures.get(request_id))
                continue
            flight = self._flights.get(request_id)
            if flight is None:
                continue
            channel = flight.channel
            self._admission.release(channel)  # the request left the waiting queue (or finished)
            if usage is not None:
                del self._flights[request_id]
            error = failures.get(request_id)
            if error is not None:
                channel.send(error)
                continue
            for delta in group:
                flight.received.add(delta)
            channel.send(group)
