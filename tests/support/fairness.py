"""The two-tenant fairness workload, in process and over HTTP: tenant a bursts, tenant b keeps asking.

The engine is the real one (scheduler, KV cache, sampler, SDK, server) over a tiny model whose
forward is replaced by a fixed-time step (``fixed_time_steps``), so a step costs the same
whatever the batch holds and the figures measure scheduling, not the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

# Seats for a fraction of the burst, and steps long enough to dwarf the Python around them.
ENGINE_CONFIG: dict[str, Any] = dict(num_blocks=2048, block_size=16, max_num_seqs=32, max_num_batched_tokens=2048)
STEP_SECONDS = 0.05
NUM_BURST = 500  # tenant a, all at once
BURST_MAX_TOKENS = 4
NUM_PROBES = 10  # tenant b, one every PROBE_GAP seconds during the burst
PROBE_GAP = 0.05
PROBE_MAX_TOKENS = 2
# Greedy: the sampler's cost then hardly grows with the batch (random sampling over the vocabulary does).
GREEDY: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)


@contextlib.contextmanager
def fixed_time_steps(engine: Any, seconds: float = STEP_SECONDS) -> Iterator[None]:
    """Replace an ``AsyncEngine``'s forward with one that sleeps ``seconds`` and favours one ordinary token."""
    import torch

    runner = engine.engine.runner
    token_id = engine.tokenizer.encode(" ok", add_special_tokens=False)[0]

    def execute_model(scheduler_output: Any) -> torch.Tensor:
        time.sleep(seconds)
        logits = torch.zeros(scheduler_output.num_logits, runner.vocab_size)
        logits[:, token_id] = 1.0
        return logits

    runner.execute_model = execute_model
    try:
        yield
    finally:
        del runner.execute_model


@dataclass
class Outcome:
    probe_ttfts: list[float]  # seconds, tenant b
    num_burst_completed: int  # tenant a requests that ended with all their tokens

    @property
    def probe_p99(self) -> float:
        """p99 by nearest rank (the largest of ten)."""
        ranked = sorted(self.probe_ttfts)
        return ranked[math.ceil(0.99 * len(ranked)) - 1]


async def run_workload(
    burst_one: Callable[[int], Awaitable[int]] | None,
    probe_one: Callable[[int], Awaitable[float]],
    num_in_engine: Callable[[], int],
) -> Outcome:
    """Tenant a's burst (unless None), then tenant b's probes while the engine serves the burst.

    Args:
        burst_one: sends a's request ``i``; returns the tokens it got.
        probe_one: sends b's request ``i``; returns its time to first token in seconds.
        num_in_engine: the requests the engine holds (waiting and running); the probes start
            once the whole burst has reached the engine.
    """
    burst = [asyncio.ensure_future(burst_one(i)) for i in range(NUM_BURST)] if burst_one is not None else []
    if burst:
        deadline = time.monotonic() + 60
        while num_in_engine() + sum(task.done() for task in burst) < NUM_BURST:
            assert time.monotonic() < deadline, "the burst never reached the engine"
            await asyncio.sleep(0.01)
    probes = []
    for i in range(NUM_PROBES):
        probes.append(asyncio.ensure_future(probe_one(i)))
        await asyncio.sleep(PROBE_GAP)
    ttfts = list(await asyncio.gather(*probes))
    if burst:
        assert not all(task.done() for task in burst), "the burst ended before the probes: no contention measured"
    tokens = await asyncio.gather(*burst)
    return Outcome(ttfts, sum(n == BURST_MAX_TOKENS for n in tokens))
