"""Embeddings, reranking and relevance scores through the SDK: their result types and their limits, on any
transport (in process or remote).

``AsyncClient.embed`` / ``.rerank`` / ``.score`` check their inputs here and run them through
``sdk.pooling_run`` (limits, hooks, audit); a transport answers ``Transport.embed`` / ``Transport.score``
with a ``Pooled`` batch. The results are the same pydantic types either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from pydantic import BaseModel, ConfigDict

from engine.errors import ParameterError
from engine.pooling.params import PoolingParams
from sdk.errors import InvalidRequestError
from sdk.fields import from_engine

MAX_INPUTS = 2048  # inputs of one embedding request (OpenAI's bound)
MAX_DOCUMENTS = 1000  # documents of one rerank or score request
EmbedInputLike = Union[str, list[int], Sequence[Union[str, list[int]]]]


class PoolingUsage(BaseModel):
    """Tokens the model read (a pooling request generates none: ``total_tokens == prompt_tokens``)."""

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int
    embedding: list[float]


class EmbeddingResult(BaseModel):
    """``AsyncClient.embed``'s answer: one ``Embedding`` per input, in input order."""

    model_config = ConfigDict(frozen=True)

    model: str
    data: list[Embedding]
    usage: PoolingUsage

    @property
    def embeddings(self) -> list[list[float]]:
        return [d.embedding for d in self.data]


class RerankItem(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int  # the document's position in the request
    relevance_score: float
    document: str | None = None  # with return_documents


class RerankResult(BaseModel):
    """``AsyncClient.rerank``'s answer: the documents by ``relevance_score``, highest first (``top_n`` of them)."""

    model_config = ConfigDict(frozen=True)

    model: str
    results: list[RerankItem]
    usage: PoolingUsage


class ScoreResult(BaseModel):
    """``AsyncClient.score``'s answer: each document's relevance to the query, in document order."""

    model_config = ConfigDict(frozen=True)

    model: str
    scores: list[float]
    usage: PoolingUsage


def pooling_params(options: dict[str, Any]) -> PoolingParams:
    """``PoolingParams`` from keyword options (``dimensions``, ``normalize``, ``truncate_prompt_tokens``,
    ``use_activation``, ``prompt_name``).

    Raises:
        InvalidRequestError: an unknown option, or a value out of its bounds (``param`` names it).
    """
    known = PoolingParams.__dataclass_fields__
    for name in options:
        if name not in known:
            raise InvalidRequestError.about(name, f"is not an option of embed, rerank or score (known: {', '.join(known)})")
    try:
        return PoolingParams(**options)
    except ParameterError as exc:
        raise from_engine(exc) from None


def embed_inputs(input: EmbedInputLike) -> list[str | list[int]]:
    """The inputs of an embedding request: one text or token-id list, or several.

    Raises:
        InvalidRequestError: no input, an empty one, or more than ``MAX_INPUTS`` (``param``: ``input`` or ``input.i``).
    """
    single = isinstance(input, str) or (isinstance(input, list) and bool(input) and isinstance(input[0], int))
    inputs = [input] if single else list(input)  # type: ignore[list-item]
    _check_count("input", len(inputs), MAX_INPUTS)
    for i, item in enumerate(inputs):
        if not isinstance(item, (str, list)) or (isinstance(item, list) and not all(isinstance(t, int) for t in item)):
            raise InvalidRequestError.about(f"input.{i}", "must be a string or a list of token ids")
        if not item:
            raise InvalidRequestError.about(f"input.{i}", "must not be empty")
    return inputs  # type: ignore[return-value]


def score_inputs(query: str | Sequence[str], documents: str | Sequence[str]) -> tuple[str | list[str], list[str]]:
    """The query (one, or one per document: pairs) and the documents of a rerank or score request, checked.

    Raises:
        InvalidRequestError: an empty query, queries not one per document, no document, an empty one, or more
            than ``MAX_DOCUMENTS`` (``param``: ``query``, ``query.i``, ``documents`` or ``documents.i``).
    """
    docs = [documents] if isinstance(documents, str) else list(documents)
    _check_count("documents", len(docs), MAX_DOCUMENTS)
    for i, doc in enumerate(docs):
        if not isinstance(doc, str) or not doc:
            raise InvalidRequestError.about(f"documents.{i}", "must be a non-empty string")
    if isinstance(query, str) or not isinstance(query, Sequence):
        if not isinstance(query, str) or not query:
            raise InvalidRequestError.about("query", "must be a non-empty string")
        return query, docs
    queries = list(query)
    if len(queries) == 1:  # NOTE: vLLM's reading: one query in a list is the query of every document
        return score_inputs(queries[0], docs)
    if len(queries) != len(docs):
        raise InvalidRequestError.about("query", f"has {len(queries)} items: give one query, or one per document ({len(docs)})")
    for i, q in enumerate(queries):
        if not isinstance(q, str) or not q:
            raise InvalidRequestError.about(f"query.{i}", "must be a non-empty string")
    return queries, docs


def _check_count(field: str, count: int, limit: int) -> None:
    if count == 0:
        raise InvalidRequestError.about(field, "must not be empty")
    if count > limit:
        raise InvalidRequestError.about(field, f"has {count} items, over the limit of {limit}")


def usage(num_tokens: int) -> PoolingUsage:
    return PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)


def ranked(scores: Sequence[float], documents: Sequence[str], top_n: int | None, return_documents: bool) -> list[RerankItem]:
    """The documents by score, highest first (ties: request order); the first ``top_n`` (None: all)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    return [RerankItem(index=i, relevance_score=scores[i], document=documents[i] if return_documents else None) for i in order]


def check_top_n(top_n: int | None) -> None:
    """Raises InvalidRequestError for a ``top_n`` below 1 (None: every document)."""
    if top_n is not None and (not isinstance(top_n, int) or top_n < 1):
        raise InvalidRequestError.about("top_n", f"must be an integer >= 1; got {top_n!r}")
