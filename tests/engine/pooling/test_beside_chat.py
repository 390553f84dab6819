"""An embedder beside a chat model in one process: embedding bursts change no generated token."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine import AsyncEngine, SamplingParams
from engine.chat_pace import CHAT_PACE
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


async def test_shared_steps_hold_after_a_restart(minilm_dir: Path) -> None:
    """``share_steps()`` makes a pooling engine yield to the process's chat engines (``CHAT_PACE``) and keeps
    its full budget for when they are idle; the fresh engine a restart starts (what the supervisor runs after
    the driver died) yields the same way."""
    async with AsyncEngine(model=str(minilm_dir), dtype="float32", device="cpu") as embedder:
        assert await embedder.call(lambda e: e.pooling.pace) is None
        await embedder.share_steps()
        assert await embedder.call(lambda e: (e.pooling.pace, e.pooling.token_budget)) == (
            CHAT_PACE, POOLING_TOKEN_BUDGET["cpu"]
        )
        fresh = embedder._start_engine()
        assert fresh.pooling is not None and fresh.pooling.pace is CHAT_PACE


async def test_an_embedding_burst_runs_a_layer_between_two_chat_decodes(tiny_model_factory, minilm_dir: Path) -> None:
    """A chat engine whose ``pooling_time_fraction`` leaves no time (a layer a turn, at least) decodes while 60
    200-token inputs wait on an embedder beside it: each turn the embedder takes while the chat has requests runs
    one layer, and it takes turns while the chat decodes (neither starves); batches it starts meanwhile stay
    within the shared budget, and once the chat is idle it runs whole batches of its full budget again; every
    embedding arrives. (How many turns fall between two chat steps is the threads' timing, not asserted.)"""
    events: list[tuple] = []  # appended by the two driver threads, in the order of their turns (STEP_LOCK)

    def record_chat(engine) -> None:
        step = engine.step_deltas

        def recorded():
            events.append(("chat", engine.has_unfinished_requests()))
            return step()

        engine.step_deltas = recorded

    def record_layers(engine) -> None:
        queue = engine.pooling
        runner, start, batch_budget, step = queue.runner, queue.runner.start, queue.batch_budget, queue.step

        def turn() -> int:
            events.append(("turn", queue.turn_seconds() is not None))
            return step()

        def budget(turn_s):
            events.append(("budget", turn_s is None, batch_budget(turn_s)))
            return events[-1][2]

        def recorded(kind, inputs, params):
            run = start(kind, inputs, params)
            events.append(("batch", sum(len(i.token_ids) for i in inputs)))
            advance = run.advance

            def layer() -> None:
                events.append(("layer",))
                advance()

            run.advance = layer
            return run

        runner.start, queue.batch_budget, queue.step = recorded, budget, turn

    async with AsyncEngine(
        model=str(tiny_model_factory("llama")), num_blocks=64, pooling_time_fraction=1e-9
    ) as chat, AsyncEngine(model=str(minilm_dir), dtype="float32", device="cpu") as embedder:
        await embedder.share_steps()
        await chat.call(record_chat)
        await embedder.call(record_layers)
        burst = [asyncio.ensure_future(embedder.embed([1000 + i] * 200)) for i in range(60)]
        await asyncio.wait(burst, return_when=asyncio.FIRST_COMPLETED)  # a full batch ran: the burst is under way
        last = None
        async for last in chat.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)):
            pass
        embeddings = await asyncio.gather(*burst)
    assert len(last.outputs[0].token_ids) == 24 and len(embeddings) == 60
    chat_steps = [i for i, e in enumerate(events) if e == ("chat", True)]
    turns = [i for i, e in enumerate(events) if e[0] == "turn"] + [len(events)]
    limited = [  # the layers of each turn taken with a limit before the chat's last step (it had requests throughout)
        sum(e == ("layer",) for e in events[a:b])
        for a, b in zip(turns, turns[1:]) if events[a][1] and a < chat_steps[-1]
    ]  # fmt: skip
    assert limited and max(limited) == 1, limited
    assert any(e == ("layer",) for e in events[chat_steps[0] : chat_steps[-1]])
    starts = [(i, events[i], events[i + 1]) for i, e in enumerate(events) if e[0] == "budget"]  # (at, budget, batch)
    assert all(batch[1] <= max(budget[2], 200) for _, budget, batch in starts)  # one input at least
    during = [budget for i, budget, _ in starts if chat_steps[0] < i < chat_steps[-1]]
    assert during and all(not alone and size <= SHARED_POOLING_BUDGET for _, alone, size in during)
    after = [batch[1] for i, _, batch in starts if i > chat_steps[-1]]
    assert after and max(after) == 2000  # ten 200-token inputs: the full budget of 2048
