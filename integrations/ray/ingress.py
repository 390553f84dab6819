"""``Ingress``: the fleet's HTTP entry on Ray Serve; hashes each prompt's prefix and relays to a replica.

Ray Serve's HTTP proxy hands the ingress every request. The ingress computes the request's
routing key (``integrations.ray.prefix``) off the event loop and calls the engine deployment
through a streaming handle, whose ``PrefixAffinityRouter`` picks the replica. Whatever the
replica's server answers (a body, an OpenAI error, SSE events) goes back unchanged.

Faults: a replica that dies before the answer started reaching the client (a whole JSON body is
held until its end; an event stream until its first event) costs nothing but time: the request
is sent again, to another replica when one is up, up to ``max_attempts`` times; then it gets a
503 ``replica_unavailable`` with ``Retry-After``. A stream that already started ends with an SSE
error event (code ``replica_failed``, retryable) and ``[DONE]``. Ray Serve replaces the replica.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from integrations.openai_server.errors import RETRY_AFTER, ApiError
from integrations.openai_server.sse import DONE, encode
from integrations.ray.prefix import PrefixHasher
from integrations.ray.replica import ForwardedRequest, ResponseHead
from integrations.ray.router import PREFIX_KWARG

logger = logging.getLogger(__name__)

DEFAULT_MAX_ATTEMPTS = 3  # replicas a request is sent to before it is answered 503
REPLICA_FAULTS = (RayActorError, ActorUnavailableError)  # the replica died or cannot be reached


class Ingress:
    """A Ray Serve deployment class: the HTTP entry of the fleet.

    Args:
        engine: the handle of the ``EngineReplica`` deployment (bound by ``build_app``).
        args: the ``paged serve`` flags: the model (for its tokenizer) and the engine's block size.
        max_attempts: replicas tried for a request that has not started answering.
    """

    def __init__(self, engine: DeploymentHandle, args: argparse.Namespace, max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> None:
        from transformers import AutoTokenizer

        from engine.loader import resolve_model
        from integrations.engine_flags import engine_config

        config = engine_config(args)
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model), local_files_only=True)
        self._hasher = PrefixHasher(tokenizer, config.block_size)
        self._engine = engine.options(stream=True)
        self._max_attempts = max_attempts

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        forwarded = ForwardedRequest(request.method, path, tuple(request.headers.items()), body)
        prefix = await asyncio.to_thread(self._hasher.hashes, request.url.path, body) if body else []
        for attempt in range(1, self._max_attempts + 1):
            stream: DeploymentResponseGenerator = self._engine.forward.remote(forwarded, **{PREFIX_KWARG: prefix})
            try:
                head: ResponseHead = await anext(stream)
                if not head.is_event_stream:
                    chunks = [chunk async for chunk in stream]
                    return Response(b"".join(chunks), status_code=head.status, headers=dict(head.headers))
                first = await anext(stream, b"")
            except REPLICA_FAULTS as exc:
                stream.cancel()
                logger.warning("replica failed before answering (attempt %d/%d): %s", attempt, self._max_attempts, exc)
                continue
            except BaseException:
                stream.cancel()
                raise
            return StreamingResponse(_events(first, stream), status_code=head.status, headers=dict(head.headers))
        error = ApiError(
            503, "no replica could serve the request; retry", code="replica_unavailable",
            headers={"Retry-After": RETRY_AFTER},
        )  # fmt: skip
        return JSONResponse(error.body().model_dump(), status_code=error.status, headers=error.headers)


async def _events(first: bytes, stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The replica's SSE bytes; a replica that dies mid-stream ends it with a retryable error event.

    Closing it (the client went away) cancels the replica's relay, which aborts the engine request.
    """
    try:
        yield first
        async for chunk in stream:
            yield chunk
    except REPLICA_FAULTS as exc:
        logger.warning("replica failed mid-stream: %s", exc)
        error = ApiError(503, "the replica serving this stream failed; retry the request", code="replica_failed")
        yield encode(error.body())
        yield DONE
    finally:
        stream.cancel()

