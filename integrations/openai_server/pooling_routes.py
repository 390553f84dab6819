"""The pooling routes: ``/v1/embeddings`` (OpenAI's shape), ``/v1/rerank`` and ``/rerank`` (Jina / Cohere's
shape as vLLM serves it), ``/v1/score`` and ``/score`` (vLLM's shape).

Each runs through the tenant's SDK client (``AsyncClient.embed`` / ``.rerank`` / ``.score``), so the
server's hooks (filters, audit) see it with its peer and headers, and its rate limits and concurrency cap
hold as on chat; a filter's block is a 400 ``content_filter`` naming the input under the route's field; ``/metrics`` counts the requests and the tokens read
(``paged_pooling_requests_total{route}``, ``paged_pooling_prompt_tokens_total{route}``). The inputs'
limits are the SDK's (``sdk.retrieval.MAX_INPUTS``, ``MAX_DOCUMENTS``); a bad input is a 400 naming
its field (``input.3``, ``documents``, ``text_2.1``).

``truncate_prompt_tokens`` (vLLM's field): absent = cut at the model's length (as sentence-transformers
cuts), ``-1`` the same, ``k`` = the first k tokens, ``null`` = no truncation (a longer input is a 400).
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from integrations.openai_server import protocol as p
from integrations.openai_server.errors import ApiError, from_sdk
from integrations.openai_server.intake import check_common, origin, parse_body
from integrations.openai_server.state import STATE, TENANT, ServerState, route_request
from sdk.errors import ContentBlocked, InvalidRequestError, PagedError


class _PoolingBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    # vLLM's extras, as engine.PoolingParams reads them (None: the model's own)
    truncate_prompt_tokens: int | None = -1
    normalize: bool | None = None
    use_activation: bool = True
    prompt_name: str | None = None

    def unsupported(self) -> str | None:
        return None

    def options(self) -> dict[str, Any]:
        """The ``engine.PoolingParams`` fields of the body."""
        return self.model_dump(include={"truncate_prompt_tokens", "normalize", "use_activation", "prompt_name"})


class EmbeddingsRequest(_PoolingBody):
    """OpenAI's ``/v1/embeddings`` body."""

    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def options(self) -> dict[str, Any]:
        out = super().options()
        if self.dimensions is not None:
            out["dimensions"] = self.dimensions
        return out


class RerankRequest(_PoolingBody):
    """``/v1/rerank``'s body (Jina / Cohere; vLLM's ``top_n`` 0 = every document)."""

    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True


class ScoreRequest(_PoolingBody):
    """vLLM's ``/v1/score`` body: ``text_1`` one query (or one per ``text_2`` item), ``text_2`` the documents."""

    text_1: str | list[str]
    text_2: str | list[str]


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/rerank", rerank)
    app.router.add_post("/rerank", rerank)
    app.router.add_post("/v1/score", score)
    app.router.add_post("/score", score)


async def _client_and_body(request: web.Request, kind: type[_PoolingBody]) -> tuple[Any, Any, ServerState, str]:
    """The tenant's SDK client, the checked body, the server's state and the served model's name."""
    state = request.app[STATE]
    state.require_serving()
    tenant = request[TENANT]
    body = await parse_body(request, kind, tenant)
    serving = route_request(request, body.model, pooling=True)
    check_common(body, serving, tenant)
    return serving.client(tenant.name, tenant.policy), body, state, serving.model_name


def _options(request: web.Request, body: _PoolingBody) -> dict[str, Any]:
    """The SDK call's keywords: the body's pooling options and who sent it (for the hooks and the audit)."""
    return {**body.options(), "origin": origin(request)}


def _error(exc: PagedError, names: dict[str, str] | None = None) -> ApiError:
    """The SDK's error as the HTTP answer, its field under the route's name (``names``: SDK -> wire)."""
    if isinstance(exc, (InvalidRequestError, ContentBlocked)) and names and exc.param is not None:
        head, _, rest = exc.param.partition(".")
        if head in names:
            exc = exc.at(names[head] + (f".{rest}" if rest else ""))
    return from_sdk(exc, None)


def _count(state: ServerState, route: str, num_tokens: int) -> None:
    state.metrics.pooling_requests.labels(route).inc()
    state.metrics.pooling_tokens.labels(route).inc(num_tokens)


async def embeddings(request: web.Request) -> web.Response:
    client, body, state, model = await _client_and_body(request, EmbeddingsRequest)
    try:
        result = await client.embed(body.input, **_options(request, body))
    except PagedError as exc:
        raise _error(exc) from None
    _count(state, "/v1/embeddings", result.usage.prompt_tokens)
    data = [
        {"object": "embedding", "index": d.index, "embedding": _encode(d.embedding, body.encoding_format)}
        for d in result.data
    ]
    return web.json_response(
        {"object": "list", "data": data, "model": model, "usage": result.usage.model_dump()}
    )


async def rerank(request: web.Request) -> web.Response:
    client, body, state, model = await _client_and_body(request, RerankRequest)
    top_n = body.top_n or None  # NOTE: vLLM reads 0 as every document
    try:
        result = await client.rerank(
            body.query, body.documents, top_n=top_n, return_documents=body.return_documents, **_options(request, body)
        )
    except PagedError as exc:
        raise _error(exc) from None
    _count(state, "/v1/rerank", result.usage.prompt_tokens)
    results = []
    for item in result.results:
        out: dict[str, Any] = {"index": item.index, "relevance_score": item.relevance_score}
        if item.document is not None:
            out["document"] = {"text": item.document}
        results.append(out)
    return web.json_response(
        {"id": p.random_id("rerank"), "model": model, "usage": result.usage.model_dump(), "results": results}
    )


async def score(request: web.Request) -> web.Response:
    client, body, state, model = await _client_and_body(request, ScoreRequest)
    queries = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    docs = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    names = {"query": "text_1", "documents": "text_2"}
    try:
        if len(queries) not in (1, len(docs)):
            raise InvalidRequestError.about(
                "text_1", f"has {len(queries)} items: give one query, or one per text_2 item ({len(docs)})"
            )
        # NOTE: one SDK request either way (one audit record); a query per document scores pairs
        query = queries[0] if len(queries) == 1 else queries
        result = await client.score(query, docs, **_options(request, body))
    except PagedError as exc:
        raise _error(exc, names) from None
    _count(state, "/v1/score", result.usage.prompt_tokens)
    return web.json_response({
        "id": p.random_id("score"), "object": "list", "created": p.now(), "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(result.scores)],
        "usage": result.usage.model_dump(),
    })  # fmt: skip


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
