"""The retrieval surface of the SDK on the shipped MiniLM: AsyncClient / Client embed, score and rerank against the
engine's own answers, the tenant's limits, LangChain's standard embeddings suites, and the LangChain and LlamaIndex
embedding and rerank adapters."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from langchain_core.documents import Document
from langchain_tests.integration_tests import EmbeddingsIntegrationTests
from langchain_tests.unit_tests import EmbeddingsUnitTests
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from sdk import AsyncClient, Client, InvalidRequestError, RateLimited, Runtime, TenantPolicy
from sdk.integrations import langchain as lc
from sdk.integrations import llamaindex as li
from tests.support.minilm import shipped_minilm_dir

MINILM = str(shipped_minilm_dir())
RUNTIME = Runtime(MINILM, dtype="float32", device="cpu")
"""The MiniLM engine every client and adapter here shares (loaded once, on first use)."""
DOCS = ["Berlin is in Germany.", "Paris is the capital of France.", "Cats chase mice.", "The Seine flows through Paris."]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module", autouse=True)
def _close_runtime() -> Iterator[None]:
    yield
    RUNTIME.close()


@pytest.fixture(scope="module")
def engine():
    from engine import Engine

    return Engine(model=MINILM, dtype="float32", device="cpu")


def test_client_embed_score_rerank_are_the_engines(engine) -> None:
    client = Client(runtime=RUNTIME)
    result = client.embed(DOCS)
    np.testing.assert_allclose(result.embeddings, [o.outputs.embedding for o in engine.embed(DOCS)], atol=1e-6)
    assert result.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in engine.embed(DOCS))
    np.testing.assert_allclose(client.embed(DOCS[0]).embeddings[0], engine.embed(DOCS[0])[0].outputs.embedding, atol=1e-6)
    expected = [o.outputs.score for o in engine.score(QUERY, DOCS)]
    np.testing.assert_allclose(client.score(QUERY, DOCS).scores, expected, atol=1e-6)
    ranked = client.rerank(QUERY, DOCS, top_n=2)
    assert [r.index for r in ranked.results] == sorted(range(len(DOCS)), key=lambda i: -expected[i])[:2]
    assert [r.document for r in ranked.results] == [DOCS[r.index] for r in ranked.results]
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens") as error:
        client.embed("x", truncate_prompt_tokens=1)
    assert error.value.param == "truncate_prompt_tokens"
    with pytest.raises(InvalidRequestError) as error:
        client.embed("x", temperature=0.5)
    assert error.value.param == "temperature"


async def test_tenant_limits_hold_for_embeddings() -> None:
    client = AsyncClient(runtime=RUNTIME, tenant="t", policy=TenantPolicy(requests_per_minute=2))
    await client.embed("one")
    await client.rerank(QUERY, DOCS)
    with pytest.raises(RateLimited, match="requests_per_minute"):
        await client.embed("three")
    assert client.limiter is not None and client.limiter.num_in_flight == 0
    tokens = AsyncClient(runtime=RUNTIME, tenant="u", policy=TenantPolicy(tokens_per_minute=50))
    with pytest.raises(InvalidRequestError, match="tokens_per_minute is 50") as error:  # it could never run
        await tokens.embed(["word " * 100])
    assert error.value.param == "input"
    assert tokens.limiter is not None and tokens.limiter.num_in_flight == 0


class TestPagedEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[lc.PagedEmbeddings]:
        return lc.PagedEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {"runtime": RUNTIME}


class TestPagedEmbeddingsIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[lc.PagedEmbeddings]:
        return lc.PagedEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {"runtime": RUNTIME}


async def test_langchain_embeddings_and_rerank(engine) -> None:
    embeddings = lc.PagedEmbeddings(runtime=RUNTIME)
    expected = [o.outputs.embedding for o in engine.embed(DOCS)]
    np.testing.assert_allclose(embeddings.embed_documents(DOCS), expected, atol=1e-6)
    np.testing.assert_allclose(await embeddings.aembed_documents(DOCS), expected, atol=1e-6)
    assert embeddings.embed_documents([]) == []
    np.testing.assert_allclose(await embeddings.aembed_query(DOCS[1]), expected[1], atol=1e-6)
    rerank = lc.PagedRerank(runtime=RUNTIME, top_n=2)
    docs = [Document(page_content=d, metadata={"n": i}) for i, d in enumerate(DOCS)]
    scores = [o.outputs.score for o in engine.score(QUERY, DOCS)]
    best = sorted(range(len(DOCS)), key=lambda i: -scores[i])[:2]
    for kept in (rerank.compress_documents(docs, QUERY), await rerank.acompress_documents(docs, QUERY)):
        assert [d.metadata["n"] for d in kept] == best
        np.testing.assert_allclose([d.metadata["relevance_score"] for d in kept], [scores[i] for i in best], atol=1e-6)
    assert rerank.compress_documents([], QUERY) == []


async def test_llamaindex_embedding_and_rerank(engine) -> None:
    embedding = li.PagedEmbedding(runtime=RUNTIME)
    expected = [o.outputs.embedding for o in engine.embed(DOCS)]
    np.testing.assert_allclose(embedding.get_text_embedding_batch(DOCS), expected, atol=1e-6)
    np.testing.assert_allclose(embedding.get_query_embedding(DOCS[0]), expected[0], atol=1e-6)
    np.testing.assert_allclose(await embedding.aget_text_embedding_batch(DOCS), expected, atol=1e-6)
    np.testing.assert_allclose(await embedding.aget_query_embedding(DOCS[2]), expected[2], atol=1e-6)
    rerank = li.PagedRerank(runtime=RUNTIME, top_n=2)
    nodes = [NodeWithScore(node=TextNode(text=d, id_=str(i)), score=0.0) for i, d in enumerate(DOCS)]
    scores = [o.outputs.score for o in engine.score(QUERY, DOCS)]
    best = sorted(range(len(DOCS)), key=lambda i: -scores[i])[:2]
    for kept in (rerank.postprocess_nodes(nodes, QueryBundle(QUERY)), await rerank.apostprocess_nodes(nodes, QueryBundle(QUERY))):
        assert [n.node.node_id for n in kept] == [str(i) for i in best]
        np.testing.assert_allclose([n.score for n in kept], [scores[i] for i in best], atol=1e-6)
