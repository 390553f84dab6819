"""The shared-prefix workload that judges routing: system prompts x questions, prefix hit rate measured.

Each request is a chat with one of ``num_prompts`` long system prompts and its own question,
sent in a seeded random order by ``concurrency`` workers.
The hit rate is the one the server reports: ``usage.prompt_tokens_details.cached_tokens`` over
``usage.prompt_tokens``, summed over the requests. With several base URLs the requests go to them
in turn: round-robin routing done by the client, the contrast to a fleet's own routing.

    python -m integrations.ray.workload --base-url http://127.0.0.1:8000 --api-key KEY
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import aiohttp

TOPICS = ("tide tables", "sourdough baking", "bicycle repair", "tax forms", "alpine botany", "chess openings")


@dataclass(frozen=True, slots=True)
class HitRate:
    """The server-reported prefix-cache figures of one workload run."""

    num_requests: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def system_prompt(index: int) -> str:
    """A system prompt of about 150 tokens, different for each index from its first words."""
    topic = TOPICS[index % len(TOPICS)]
    rules = " ".join(f"Rule {r}: when asked about {topic}, answer in at most {r + 2} words." for r in range(8))
    return f"You are assistant number {index}, an expert in {topic}. {rules}"


def workload(num_prompts: int = 4, num_questions: int = 32, seed: int = 0) -> list[list[dict[str, str]]]:
    """The chats, in a seeded random order.

    NOTE: not interleaved by prompt: taking servers in turn over a period that divides the
    number of prompts would send every prompt to one server, which is no round-robin at all.
    """
    chats = [
        [
            {"role": "system", "content": system_prompt(p)},
            {"role": "user", "content": f"Question {q}: what is {q} times {p + 3}?"},
        ]
        for q, p in itertools.product(range(num_questions), range(num_prompts))
    ]
    random.Random(seed).shuffle(chats)
    return chats


async def measure(
    base_urls: Sequence[str],
    api_key: str | None = None,
    *,
    num_prompts: int = 4,
    num_questions: int = 32,
    concurrency: int = 8,
    max_tokens: int = 1,
) -> HitRate:
    """Runs the workload against the OpenAI-compatible servers at ``base_urls`` (in turn).

    Raises:
        aiohttp.ClientResponseError: a request that did not succeed.
    """
    chats = workload(num_prompts, num_questions)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue: asyncio.Queue[tuple[int, list[dict[str, str]]]] = asyncio.Queue()
    for item in enumerate(chats):
        queue.put_nowait(item)
    usages: list[dict] = []

    async def worker(session: aiohttp.ClientSession, model: str) -> None:
        while not queue.empty():
            i, messages = queue.get_nowait()
            url = base_urls[i % len(base_urls)].rstrip("/") + "/v1/chat/completions"
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            async with session.post(url, json=body, headers=headers, raise_for_status=True) as response:
                usages.append((await response.json())["usage"])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async with session.get(base_urls[0].rstrip("/") + "/v1/models", headers=headers, raise_for_status=True) as r:
            model = (await r.json())["data"][0]["id"]
        await asyncio.gather(*(worker(session, model) for _ in range(concurrency)))
    return HitRate(
        num_requests=len(usages),
        prompt_tokens=sum(u["prompt_tokens"] for u in usages),
        cached_tokens=sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", action="append", required=True, help="server root; repeat for round-robin")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    result = asyncio.run(
        measure(args.base_url, args.api_key, num_prompts=args.prompts, num_questions=args.questions,
                concurrency=args.concurrency)
    )  # fmt: skip
    print(json.dumps({**asdict(result), "hit_rate": round(result.hit_rate, 4)}))


if __name__ == "__main__":
    main()
