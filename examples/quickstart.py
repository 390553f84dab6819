"""Quickstart: one shared system prompt, several concurrent questions, and the engine's figures.

    python examples/quickstart.py [--max-tokens 48] [--model PATH]

The system prompt is pinned once with ``client.prefix``; every question starts with it,
so its KV blocks are computed once and shared by all the concurrent requests.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from sdk import AsyncClient, ChatMessage

SYSTEM = (
    "You are the help desk of the Old Mill Bakery in Lyon. The bakery opens at 7 am and closes "
    "at 7 pm, Tuesday to Sunday; it is closed on Mondays. It sells sourdough loaves, croissants, "
    "pains au chocolat, brioche and seasonal fruit tarts. Orders for cakes need two days' notice. "
    "The bakery does not deliver, but customers may collect orders from 7 am. Answer politely, in "
    "one or two short sentences, and never invent products or opening hours."
)

QUESTIONS = [
    "When do you open on Saturday?",
    "Are you open on Monday?",
    "Do you deliver to my office?",
    "Can I order a birthday cake for tomorrow?",
    "What kind of bread do you sell?",
    "Do you have croissants?",
    "What time do you close?",
    "Do you sell fruit tarts in summer?",
]


async def main(max_tokens: int, model: str | None) -> None:
    client = AsyncClient(model)
    started = time.perf_counter()
    await client.start()
    print(f"model {client.model_name} loaded in {time.perf_counter() - started:.1f}s")

    async with await client.prefix(SYSTEM) as system:
        conversations = [[*system.messages, ChatMessage(role="user", content=q)] for q in QUESTIONS]
        started = time.perf_counter()
        results = await client.batch(conversations, max_tokens=max_tokens, temperature=0)
        elapsed = time.perf_counter() - started

    for question, result in zip(QUESTIONS, results, strict=True):
        print(f"\nQ: {question}\nA: {result.text.strip()}")

    stats = client.stats()
    num_out = sum(r.usage.completion_tokens for r in results)
    num_prompt = sum(r.usage.prompt_tokens for r in results)
    num_cached = sum(r.usage.cached_tokens for r in results)
    print("\n--- figures ---")
    print(f"requests:                 {len(results)} concurrent, {elapsed:.2f}s wall")
    print(f"output throughput:        {num_out / elapsed:.1f} tokens/s ({num_out} tokens)")
    print(f"prefix-cache hit rate:    {num_cached / num_prompt:.1%} of this batch's prompt tokens "
          f"({num_cached}/{num_prompt})")  # fmt: skip
    print(f"system prompt:            {system.num_tokens} tokens, pinned once, "
          f"served from cache {system.num_hit_tokens} tokens over {system.num_requests} requests")  # fmt: skip
    print(f"engine, since start:      hit rate {stats['prefix_cache_hits'] / max(stats['prefix_cache_queries'], 1):.1%}, "
          f"prompt tokens computed {stats['prompt_tokens_computed']}, preemptions {stats['num_preemptions']}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", default=None, help="HF directory or .gguf path (default: the bundled model)")
    args = parser.parse_args()
    asyncio.run(main(args.max_tokens, args.model))
