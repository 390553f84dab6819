"""An embedder beside a chat model in one process: embedding bursts change no generated token."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine import AsyncEngine, SamplingParams
from engine.pooling.pooling_queue import POOLING_TOKEN_BUDGET, SHARED_POOLING_BUDGET

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 130)), [7] * 12]


async def _generate(chat: AsyncEngine) -> list[list[int]]:
    async def one(prompt: list[int]) -> list[int]:
        last = None
        async for last in chat.generate(prompt, GREEDY):
            pass
        return last.outputs[0].token_ids

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


async def test_embedding_burst_changes_no_generated_token(tiny_model_factory, minilm_dir: Path) -> None:
    """Greedy tokens of concurrent chat requests are the same with and without 40 embedding requests in flight
    on an embedder in the same process; the embeddings all arrive."""
    async with AsyncEngine(model=str(tiny_model_factory("llama")), num_blocks=64) as chat, AsyncEngine(
        model=str(minilm_dir), dtype="float32", device="cpu"
    ) as embedder:
        alone = await _generate(chat)
        texts = [f"chunk {i} about paged attention and retrieval" for i in range(40)]
        beside, embeddings = await asyncio.gather(_generate(chat), asyncio.gather(*(embedder.embed(t) for t in texts)))
    assert beside == alone
    assert [len(e.outputs.embedding) for e in embeddings] == [384] * 40


async def test_shared_step_budget_holds_after_a_restart(minilm_dir: Path) -> None:
    """``share_steps()`` cuts a pooling engine's batches to the shared budget, and the fresh engine a restart
    starts (what the supervisor runs after the driver died) runs the same budget."""
    async with AsyncEngine(model=str(minilm_dir), dtype="float32", device="cpu") as embedder:
        assert await embedder.call(lambda e: e.pooling.token_budget) == POOLING_TOKEN_BUDGET["cpu"]
        await embedder.share_steps()
        assert await embedder.call(lambda e: e.pooling.token_budget) == SHARED_POOLING_BUDGET
        fresh = embedder._start_engine()
        assert fresh.pooling is not None and fresh.pooling.token_budget == SHARED_POOLING_BUDGET
