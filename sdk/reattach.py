"""Re-attaching to a request a server journalled as it shut down (``RequestJournalled``).

A ``paged serve --drain-journal`` server that shuts down while a request streams writes it
to its journal and ends the stream with ``RequestJournalled``; a server restarted on the same
``kv_cache_dir`` finishes it and keeps its whole result by id. ``fetch_result`` asks for that
result, waiting out a server that is still down or starting; ``rest_of`` turns it into the
stream's last delta: what follows what the stream already gave.
"""

from __future__ import annotations

import asyncio
import time

from sdk.errors import EngineRestarting
from sdk.transport import Transport
from sdk.types import CompletionResult, Delta

REATTACH_BACKOFF = 1.0  # seconds before the first retry (at least the answer's retry_after); doubled per retry
MAX_REATTACH_DELAY = 30.0


async def fetch_result(
    transport: Transport, request_id: str, max_retries: int, deadline: float | None = None
) -> CompletionResult:
    """``transport.retrieve(request_id)``, retried up to ``max_retries`` times while the server is down or starting.

    Raises:
        EngineRestarting: the server was still unreachable or starting after the last try (or
            the next try would start past ``deadline``, a ``time.monotonic()``).
        PagedError: the server's other answers (``NotFoundError`` for an id it does not have).
    """
    for attempt in range(max_retries + 1):
        try:
            return await transport.retrieve(request_id)
        except EngineRestarting as exc:
            delay = min(max(exc.retry_after, REATTACH_BACKOFF) * 2**attempt, MAX_REATTACH_DELAY)
            if attempt == max_retries or (deadline is not None and time.monotonic() + delay >= deadline):
                raise
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


def rest_of(result: CompletionResult, request_id: str, text: str, reasoning: str, token_ids: list[int]) -> Delta | None:
    """What ``result`` (one completion) has past the ``text``, ``reasoning`` and ``token_ids`` a stream gave, as
    that stream's last delta (``finish_reason`` and ``usage`` set); None when ``result`` does not go on from them."""
    choice = result.choices[0]
    whole_reasoning = choice.reasoning or ""
    if not (choice.text.startswith(text) and whole_reasoning.startswith(reasoning)):
        return None
    if choice.token_ids[: len(token_ids)] != token_ids:
        return None
    return Delta(
        request_id, 0, choice.text[len(text) :], choice.token_ids[len(token_ids) :],
        finish_reason=choice.finish_reason, usage=result.usage, reasoning=whole_reasoning[len(reasoning) :],
    )  # fmt: skip
