"""A LangChain agent loop on PagedChat that reuses one pinned system prompt on every step.

    python examples/langchain_agent.py [--max-tokens 40]

The loop looks each question up in a small knowledge base (a plain Python tool), then
asks the chain ``prompt | PagedChat | StrOutputParser`` to answer from what it found,
keeping the conversation history. Every step starts with the same system prompt, pinned
once with ``client.prefix``, so its KV is computed once for the whole loop; a final
``chain.batch`` runs three more questions concurrently on the same prefix.
"""

from __future__ import annotations

import argparse

from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder

from sdk.integrations.langchain import PagedChat

SYSTEM = (
    "You are the support agent of Northwind Trains. Answer in one short sentence, using only the "
    "facts given with each question. If the facts do not answer it, say you will ask a colleague."
)

KNOWLEDGE = {
    "bike": "Bicycles travel free on all regional trains, outside rush hours (7-9 am, 5-7 pm).",
    "refund": "Tickets are refunded in full up to 24 hours before departure, and at 50% after that.",
    "dog": "Small dogs in a basket travel free; larger dogs need a half-price ticket and a lead.",
    "wifi": "Free wifi is available on all intercity trains; regional trains have none.",
    "luggage": "Each passenger may bring two suitcases and one small bag at no extra cost.",
}


def lookup(question: str) -> str:
    """The knowledge-base tool: facts whose keyword appears in the question."""
    facts = [fact for key, fact in KNOWLEDGE.items() if key in question.lower()]
    return " ".join(facts) or "No facts found."


def main(max_tokens: int) -> None:
    chat = PagedChat(temperature=0, max_tokens=max_tokens)
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM), MessagesPlaceholder("history"), ("human", "Facts: {facts}\nQuestion: {question}")]
    )
    chain = prompt | chat | StrOutputParser()

    with chat.client.prefix(SYSTEM) as system:
        history: list = []
        for question in ["Can I take my bike on the train?", "And my dog?", "Is there wifi on board?"]:
            facts = lookup(question)
            answer = chain.invoke({"history": history, "facts": facts, "question": question})
            print(f"user:  {question}\ntool:  {facts}\nagent: {answer.strip()}\n")
            history += [HumanMessage(question), AIMessage(answer)]

        more = ["How do refunds work?", "How much luggage can I bring?", "Do you sell sandwiches?"]
        answers = chain.batch([{"history": [], "facts": lookup(q), "question": q} for q in more])
        for question, answer in zip(more, answers, strict=True):
            print(f"user:  {question}\nagent: {answer.strip()}\n")

    print(f"system prompt: {system.num_tokens} tokens, pinned once; {system.num_requests} requests "
          f"started with it and got {system.num_hit_tokens} prompt tokens from the cache")  # fmt: skip
    stats = chat.client.stats()
    print(f"engine prefix-cache hit rate: {stats['prefix_cache_hits'] / max(stats['prefix_cache_queries'], 1):.1%}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=40)
    main(parser.parse_args().max_tokens)
