"""LlamaIndex retrieval adapters: ``PagedEmbedding`` (a ``BaseEmbedding``) and ``PagedRerank`` (a
``BaseNodePostprocessor``), on an in-process pooling model or a remote one (``base_url``). Re-exported by
``sdk.integrations.llamaindex``.

    from llama_index.core import Settings, VectorStoreIndex
    Settings.embed_model = PagedEmbedding(model="path/to/all-MiniLM-L6-v2")
    index = VectorStoreIndex.from_documents(documents)
    engine = index.as_query_engine(similarity_top_k=10, node_postprocessors=[PagedRerank(model=..., top_n=3)])
"""

from __future__ import annotations

from typing import Any, ClassVar

try:
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.schema import NodeWithScore, QueryBundle
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("sdk.integrations.llamaindex needs llama-index-core: pip install 'paged[llamaindex]'") from exc
from pydantic import model_validator

from sdk.integrations.base import PoolingAdapter
from sdk.retrieval import RerankItem


class PagedEmbedding(PoolingAdapter, BaseEmbedding):
    """paged's embedding model as a LlamaIndex ``BaseEmbedding`` (sync and async, batched by the engine);
    ``query_prompt_name`` / ``text_prompt_name``: the model's prompt prefixes for queries and texts."""

    query_prompt_name: str | None = None
    """The model's prompt for queries (``"query"`` for e5 / bge-style models); None = its default, if any."""
    text_prompt_name: str | None = None
    """The model's prompt for indexed texts; None = its default, if any."""

    _route: ClassVar[str] = "llamaindex-embedding"

    @model_validator(mode="after")
    def _name_the_model(self) -> Any:
        # NOTE: BaseEmbedding's own model_name field (what LlamaIndex reports) shares the adapter's alias
        self.model_name = self.model or "unknown"
        return self

    @classmethod
    def class_name(cls) -> str:
        return "PagedEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self.embed_texts([query], self.query_prompt_name)[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return (await self.aembed_texts([query], self.query_prompt_name))[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self.embed_texts([text], self.text_prompt_name)[0]

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return (await self.aembed_texts([text], self.text_prompt_name))[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self.embed_texts(texts, self.text_prompt_name)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return await self.aembed_texts(texts, self.text_prompt_name)


class PagedRerank(PoolingAdapter, BaseNodePostprocessor):
    """paged's reranker (a cross-encoder; an embedding model ranks by cosine) as a LlamaIndex node
    postprocessor: the ``top_n`` nodes most relevant to the query, best first, ``score`` = its relevance."""

    top_n: int | None = 3
    """Nodes kept; None = all, reordered."""

    _route: ClassVar[str] = "llamaindex-rerank"

    @classmethod
    def class_name(cls) -> str:
        return "PagedRerank"

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        if query_bundle is None:
            raise ValueError("PagedRerank needs the query (query_bundle)")
        texts = [n.node.get_content() for n in nodes]
        return _scored(nodes, self.rerank_texts(query_bundle.query_str, texts, self.top_n))

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        if query_bundle is None:
            raise ValueError("PagedRerank needs the query (query_bundle)")
        texts = [n.node.get_content() for n in nodes]
        return _scored(nodes, await self.arerank_texts(query_bundle.query_str, texts, self.top_n))


def _scored(nodes: list[NodeWithScore], items: list[RerankItem]) -> list[NodeWithScore]:
    return [NodeWithScore(node=nodes[item.index].node, score=item.relevance_score) for item in items]
