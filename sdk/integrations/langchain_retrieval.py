"""LangChain retrieval adapters: ``PagedEmbeddings`` (an ``Embeddings``) and ``PagedRerank`` (a
``BaseDocumentCompressor``), on an in-process pooling model or a remote one (``base_url``: ``paged serve``'s
``/v1/embeddings`` and ``/v1/score``). Re-exported by ``sdk.integrations.langchain``.

    embeddings = PagedEmbeddings(model="path/to/all-MiniLM-L6-v2")
    store = InMemoryVectorStore.from_texts(texts, embeddings)
    rerank = PagedRerank(model="path/to/ms-marco-MiniLM-L-6-v2", top_n=3)
    best = rerank.compress_documents(store.similarity_search(query, k=20), query)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

try:
    from langchain_core.callbacks import Callbacks
    from langchain_core.documents import BaseDocumentCompressor, Document
    from langchain_core.embeddings import Embeddings
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("sdk.integrations.langchain needs langchain-core: pip install 'paged[langchain]'") from exc

from sdk.integrations.base import PoolingAdapter
from sdk.retrieval import RerankItem


class PagedEmbeddings(PoolingAdapter, Embeddings):
    """paged's embedding model as LangChain ``Embeddings`` (sync and async); queries and documents may take
    the model's prompt prefixes (``query_prompt_name``, ``document_prompt_name``: keys of its
    ``config_sentence_transformers.json`` prompts)."""

    query_prompt_name: str | None = None
    """The model's prompt for queries (``"query"`` for e5 / bge-style models); None = its default, if any."""
    document_prompt_name: str | None = None
    """The model's prompt for documents; None = its default, if any."""

    _route: ClassVar[str] = "langchain-embeddings"

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embed_texts(texts, self.document_prompt_name)

    def embed_query(self, text: str) -> list[float]:
        return self.embed_texts([text], self.query_prompt_name)[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await self.aembed_texts(texts, self.document_prompt_name)

    async def aembed_query(self, text: str) -> list[float]:
        return (await self.aembed_texts([text], self.query_prompt_name))[0]


class PagedRerank(PoolingAdapter, BaseDocumentCompressor):
    """paged's reranker (a cross-encoder; an embedding model ranks by cosine) as a LangChain document
    compressor: the ``top_n`` documents most relevant to the query, best first, each with its
    ``relevance_score`` in its metadata."""

    top_n: int | None = 3
    """Documents kept; None = all, reordered."""

    _route: ClassVar[str] = "langchain-rerank"

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        return _ranked(documents, self.rerank_texts(query, [d.page_content for d in documents], self.top_n))

    async def acompress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        return _ranked(documents, await self.arerank_texts(query, [d.page_content for d in documents], self.top_n))


def _ranked(documents: Sequence[Document], items: list[RerankItem]) -> list[Document]:
    out = []
    for item in items:
        doc = documents[item.index]
        out.append(Document(page_content=doc.page_content, id=doc.id, metadata={**doc.metadata, "relevance_score": item.relevance_score}))
    return out


