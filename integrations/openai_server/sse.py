"""Server-sent events: the framing OpenAI streaming uses (``data: {json}`` ... ``data: [DONE]``, or named events)."""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"


def encode(event: BaseModel, name: str | None = None) -> bytes:
    """``data: {json}``, after ``event: name`` when the event has a name (the Responses API's do)."""
    data = b"data: " + event.model_dump_json(exclude_unset=False).encode() + b"\n\n"
    return data if name is None else b"event: " + name.encode() + b"\n" + data


class EventStream:
    """One SSE response: prepared lazily, so errors raised before the first event still get a JSON body."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self._response is not None

    @property
    def response(self) -> web.StreamResponse:
        if self._response is None:
            raise RuntimeError("the event stream has not started")
        return self._response

    async def send(self, event: BaseModel, name: str | None = None, lead: bytes = b"") -> None:
        """Writes ``event``; ``lead`` (whole lines, e.g. an SSE comment) goes first, in the same write."""
        await self._write(lead + encode(event, name))

    async def done(self) -> web.StreamResponse:
        await self._write(DONE)
        return await self.end()

    async def end(self) -> web.StreamResponse:
        """End the stream without ``data: [DONE]`` (the Responses API's last event says it ended)."""
        await self.response.write_eof()
        return self.response

    async def _write(self, data: bytes) -> None:
        if self._response is None:
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                }
            )
            await response.prepare(self._request)
            self._response = response
        # NOTE: a write to a closed connection raises (ClientConnectionResetError), which
        # unwinds the handler and aborts the request in the engine.
        await self._response.write(data)
