"""``Ingress``: the fleet's HTTP entry on Ray Serve; hashes each prompt's prefix and relays to a replica.

Ray Serve's HTTP proxy hands the ingress every request. The ingress computes the request's
routing key (``integrations.ray.prefix``) off the event loop and calls the engine deployment
through a streaming handle, whose ``PrefixAffinityRouter`` picks the replica. Whatever the
replica's server answers (a body, an OpenAI error, SSE events) goes back unchanged.

Faults: a replica that dies before the answer started reaching the client (a whole JSON body is
held until its end; an event stream until its first event) costs nothing but time: the request
is sent again, to another replica when one is up, up to ``max_attempts`` times; then it gets a
503 ``replica_unavailable`` with ``Retry-After``. A stream that already started goes on on another
replica from the tokens its client received (``integrations.ray.failover``), within the same
``max_attempts``; one that cannot (``n > 1``, tools, logprobs, a parsed reasoning) ends with an SSE
error event (code ``replica_failed``, retryable) and ``[DONE]``. Ray Serve replaces the replica.

``GET /metrics`` asks every replica (``integrations.ray.metrics``): one exposition with a
``replica`` label on each sample. Every other route is answered by one replica.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from integrations.openai_server.errors import RETRY_AFTER, ApiError
from integrations.openai_server.metrics import CONTENT_TYPE
from integrations.openai_server.relay import Continuation
from integrations.ray.failover import REPLICA_FAULTS, relay_events
from integrations.ray.metrics import merge_expositions
from integrations.ray.prefix import PrefixHasher
from integrations.ray.replica import ForwardedRequest, ResponseHead
from integrations.ray.router import PREFIX_KWARG, REPLICA_KWARG
from integrations.ray.router_registry import replica_ids

logger = logging.getLogger(__name__)

DEFAULT_MAX_ATTEMPTS = 3  # replicas a request is sent to, continuations of its stream included
METRICS_TIMEOUT = 5.0  # seconds a replica gets to answer the fleet's /metrics; a slower one is left out
METRICS_PATH = "/metrics"


class Ingress:
    """A Ray Serve deployment class: the HTTP entry of the fleet.

    Args:
        engine: the handle of the ``EngineReplica`` deployment (bound by ``build_app``).
        args: the ``paged serve`` flags: the model (for its tokenizer) and the engine's block size.
        max_attempts: replicas a request is sent to: before it started answering, and to go on with its stream.
    """

    def __init__(self, engine: DeploymentHandle, args: argparse.Namespace, max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from engine.loader import resolve_model
        from engine.multimodal.layout import image_layout
        from integrations.engine_flags import engine_config

        config = engine_config(args)
        model_dir = resolve_model(config.model)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        images = image_layout(AutoConfig.from_pretrained(model_dir, local_files_only=True), tokenizer)
        self._hasher = PrefixHasher(tokenizer, config.block_size, images=images)
        self._engine = engine.options(stream=True)
        self._deployment = (engine.app_name, engine.deployment_name)
        self._max_attempts = max_attempts

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        forwarded = ForwardedRequest(request.method, path, tuple(request.headers.items()), body)
        if request.method == "GET" and request.url.path == METRICS_PATH:
            replicas = replica_ids(*self._deployment)
            if replicas:  # NOTE: empty until the first request made the handle's router
                return await self._metrics(forwarded, replicas)
        prefix = await asyncio.to_thread(self._hasher.hashes, request.url.path, body) if body else []
        return await self._relay(forwarded, prefix)

    async def _relay(self, forwarded: ForwardedRequest, prefix: list[bytes]) -> Response:
        """The answer of one replica, retried on another while nothing has reached the client."""
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
            def resend(continuation: Continuation) -> DeploymentResponseGenerator:
                return self._engine.forward.remote(forwarded, **{PREFIX_KWARG: prefix}, continuation=continuation)

            events = relay_events(first, stream, resend, self._max_attempts - attempt)
            return StreamingResponse(events, status_code=head.status, headers=dict(head.headers))
        error = ApiError(
            503, "no replica could serve the request; retry", code="replica_unavailable",
            headers={"Retry-After": RETRY_AFTER},
        )  # fmt: skip
        return JSONResponse(error.body().model_dump(), status_code=error.status, headers=error.headers)

    async def _metrics(self, forwarded: ForwardedRequest, replicas: list[str]) -> Response:
        """Every replica's ``/metrics``, merged; a replica's refusal (a bad key) is the answer."""

        async def scrape(replica: str) -> tuple[ResponseHead, bytes] | None:
            stream = self._engine.forward.remote(forwarded, **{REPLICA_KWARG: replica})
            try:
                async with asyncio.timeout(METRICS_TIMEOUT):
                    head = await anext(stream)
                    return head, b"".join([chunk async for chunk in stream])
            except (TimeoutError, *REPLICA_FAULTS):
                return None  # gone or busy: the others still answer
            finally:
                stream.cancel()

        # NOTE: one replica after the other: calls made while serving one HTTP request share Serve's
        # internal request id, and the router matches a chosen replica to a pending call by that id.
        answers = {r: a for r in replicas if (a := await scrape(r)) is not None}
        for head, body in answers.values():
            if head.status != 200:
                return Response(body, status_code=head.status, headers=dict(head.headers))
        merged = merge_expositions({r: body.decode() for r, (_, body) in answers.items()})
        return Response(merged, headers={"Content-Type": CONTENT_TYPE})

