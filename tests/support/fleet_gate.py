"""A ``paged serve --hook`` factory for the fleet tests: holds a stream on its replica until the test lets it go.

A request with the ``x-test-gate: DIR`` header is held before its ``HOLD_AFTER + 1``-th token
reaches the client: the hook writes the name of the replica's Ray actor to ``DIR/held`` and
waits until ``DIR/go`` exists. The test kills that actor meanwhile, knowing the client holds
exactly ``HOLD_AFTER`` tokens. Other requests pass untouched.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from sdk.hooks import Hook

GATE_HEADER = "x-test-gate"
HOLD_AFTER = 6  # tokens the client gets before the stream is held
POLL = 0.01  # seconds between looks for DIR/go


class StreamGate(Hook):
    async def on_chunk(self, ctx, delta):  # noqa: ANN001, ANN201
        gate = ctx.headers.get(GATE_HEADER)
        if gate is None or len(ctx.output_token_ids[delta.index]) != HOLD_AFTER:
            return None
        go = Path(gate) / "go"
        if go.exists():
            return None  # NOTE: the continuation on another replica passes
        import ray

        held = Path(gate) / "held"
        held.with_suffix(".tmp").write_text(ray.get_runtime_context().get_actor_name() or "")
        os.replace(held.with_suffix(".tmp"), held)
        while not go.exists():
            await asyncio.sleep(POLL)
        return None


def make_hooks() -> list[Hook]:
    return [StreamGate()]
