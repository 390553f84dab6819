"""The driver thread's inbox: the commands callers post, the channels requests stream on, how each is answered.

Callers of ``AsyncEngine`` never touch its ``Engine``: they post a command into one
thread-safe inbox and wait on what it answers with, a request's ``Channel`` or an asyncio
future on the caller's loop. Each command carries the generation (which engine) it was
posted to, so that one posted to an engine that died is answered with an error and never
run on the fresh one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.outputs import Delta, Received
from engine.processor import ProcessedRequest

if TYPE_CHECKING:
    from engine.errors import EngineError
    from engine.llm_engine import Engine


class Channel:
    """One request's stream: an asyncio queue on its consumer's loop, fed by the driver thread."""

    __slots__ = ("loop", "queue", "num_tokens", "generation", "reserved", "finished", "accepted")

    def __init__(self, loop: asyncio.AbstractEventLoop, num_tokens: int, generation: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[list[Delta] | BaseException] = asyncio.Queue()  # a step's deltas, or the error
        self.num_tokens = num_tokens
        self.generation = generation  # the engine it was admitted to; a resume moves it to the fresh one
        self.reserved = True  # holds an admission slot until it leaves the queue
        self.finished = False
        # NOTE: set by the driver once an engine took the request: from then on the driver answers
        # it on every path (its end, an error, a death: resumed or failed), so its caller waits.
        self.accepted = False

    def send(self, item: list[Delta] | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


@dataclass(slots=True)
class Add:
    """Queues ``request`` (made on the caller's side, its id set) and streams its deltas to ``channel``.

    With ``received`` it continues a run whose caller already got those tokens (a journalled request).
    """

    request: ProcessedRequest
    channel: Channel
    received: Received | None = None


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Call:
    """Runs ``fn(engine)`` on the driver thread and resolves ``future`` with its result."""

    fn: Callable[[Engine], Any]
    generation: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)


@dataclass(slots=True)
class Pin:
    """Queues the pin ``request`` and resolves ``future`` with its ``PinnedPrefix`` once computed."""

    request: ProcessedRequest
    generation: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)


class Stop:
    pass


Command = Add | Abort | Call | Pin | Stop


def posted_to(command: Command, serving: int) -> int:
    """The generation ``command`` was posted to; an abort or a stop belongs to the engine ``serving``."""
    if isinstance(command, Add):
        return command.channel.generation
    if isinstance(command, (Pin, Call)):
        return command.generation
    return serving


def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None,
            error: BaseException | None = None) -> None:
    """Settles ``future`` on its loop from any thread; a closed loop or a settled future is left alone."""
    def settle() -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


def refuse(command: Command, error: EngineError) -> None:
    """Answers a command that will not run with ``error``; an abort or a stop needs no answer."""
    if isinstance(command, Add):
        command.channel.send(error)
    elif isinstance(command, (Pin, Call)):
        resolve(command.loop, command.future, error=error)


def public_pin_id(pin_id: str, generation: int) -> str:
    """The id callers get for an engine's pin: a fresh engine numbers its pins from 0 again."""
    return pin_id if generation == 0 else f"{pin_id}.{generation}"


def engine_pin_id(public_id: str) -> tuple[str, int]:
    """``(the engine's pin id, its generation)`` of an id ``public_pin_id`` made."""
    pin_id, _, generation = public_id.partition(".")
    return pin_id, int(generation) if generation.isdigit() else 0
