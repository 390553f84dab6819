"""One embed, rerank or score request's path through ``AsyncClient``, on the chat path's machinery.

``run_pooling`` takes the steps of ``sdk.request_run.RequestRun`` that a pooling request has:

1. the rate limit's request slot (a request refused here reaches no hook, as on chat);
2. the input hooks (``HookChain.on_request``): a filter reads ``ctx.inputs`` and ``ctx.query``, may
   redact them or block the request (``ContentBlocked`` naming the input, ``HookFailed``);
3. the tokens the inputs the hooks left are estimated to need, then the engine call;
4. ``sdk.request_run.end_request``: whatever happened, the lease settled with the tokens read and the
   finish hooks (audit) run once, with ``kind`` ``embed`` / ``rerank`` / ``score`` and the usage.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Sequence

from engine.pooling.params import PoolingParams
from sdk.errors import InvalidRequestError
from sdk.hooks import RequestContext, RequestOrigin
from sdk.hooks.base import RequestKind
from sdk.request_run import RequestScope, end_request
from sdk.transport import Pooled
from sdk.types import Usage

PoolingCall = Callable[[list[str | list[int]], "str | list[str] | None"], Awaitable[Pooled]]
"""Runs a pooling request on the transport: gets the inputs and the query as the hooks left them."""

_ID_PREFIX = {"embed": "embd", "rerank": "rerank", "score": "score"}


async def run_pooling(
    scope: RequestScope,
    kind: RequestKind,
    inputs: Sequence[str | list[int]],
    params: PoolingParams,
    call: PoolingCall,
    *,
    query: str | list[str] | None = None,
    origin: RequestOrigin | None = None,
) -> Pooled:
    """Run one pooling request (``inputs`` already checked) under the scope's limits and hooks.

    Args:
        scope: the transport, hooks, policy and limits the request runs under.
        kind: ``"embed"``, ``"rerank"`` or ``"score"``: what the hooks and the audit record see.
        inputs: what it embeds, or the documents it scores against ``query``.
        params: the pooling options, for the hooks' ``ctx.params``.
        call: runs it on the transport with the inputs and query the input hooks left.
        query: a rerank or score request's query (a score request's may be one per document).
        origin: who sent it (client address, headers), for the hooks' context.

    Returns:
        The transport's answer: one value per input, and the tokens read.

    Raises:
        ContentBlocked: an input filter blocked it (``param`` names the input).
        HookFailed: a filter hook raised (fail closed).
        InvalidRequestError: the inputs need more than the whole minute's tokens (``param``: the inputs' field).
        RateLimited: as ``AsyncClient.chat``; others as the transport's ``embed`` / ``score``.
    """
    model_source = await scope.startup()
    model = scope.transport.pooling_model_name("embed" if kind == "embed" else "score")
    if model != scope.transport.model_name:
        model_source = None  # NOTE: it describes the chat engine; the pooling engine beside it is another
    origin = origin or RequestOrigin()
    ctx = RequestContext(
        request_id=f"{_ID_PREFIX[kind]}-{uuid.uuid4().hex}", model=model, route=scope.route,
        kind=kind, params=dataclasses.asdict(params), tenant=scope.tenant, client_address=origin.client_address,
        headers=origin.headers, inputs=list(inputs), query=query, model_source=model_source,
    )  # fmt: skip
    lease = scope.limiter.enter() if scope.limiter is not None else None
    try:
        await scope.hooks.on_request(ctx)
        queries = [ctx.query] if isinstance(ctx.query, str) else list(ctx.query or ())
        texts: list[str | list[int]] = [*queries, *(ctx.inputs or ())]
        if lease is not None:
            needed = _estimate_tokens(texts)
            try:
                lease.take_tokens(needed)
            except InvalidRequestError:  # NOTE: its message speaks of max_tokens, which a pooling request has not
                limit = scope.policy.tokens_per_minute if scope.policy is not None else None
                field = ctx.input_field
                raise InvalidRequestError.about(field, f"needs about {needed} tokens; tokens_per_minute is {limit}") from None
        pooled = await call(list(ctx.inputs or ()), ctx.query)
        ctx.usage = Usage(prompt_tokens=pooled.num_tokens)
        ctx.finish_reason = "stop"
        return pooled
    except BaseException as exc:  # also CancelledError: the caller went away (finish_reason "abort")
        ctx.error = exc
        raise
    finally:
        await end_request(scope, ctx, lease)


def _estimate_tokens(texts: Sequence[str | list[int]]) -> int:
    """Tokens reserved from a tokens-per-minute limit before the model reads them: a token per four characters."""
    return sum(len(t) if isinstance(t, list) else len(t) // 4 + 1 for t in texts)
