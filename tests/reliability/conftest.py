"""Reliability fixtures: a tiny model, the quiescence check bound to the test's event loop, engine settings."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from sdk import AsyncClient
from sdk.errors import EngineRestarting
from tests.support.quiescence import assert_quiescent, running_tasks

# A small cache and short sequences: every request ends within a few dozen steps.
ENGINE_CONFIG: dict[str, Any] = dict(
    num_blocks=96, block_size=4, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=128
)


@pytest.fixture(scope="session")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """The tiny random-weight llama every reliability test runs on."""
    return tiny_model_factory("llama")


@pytest.fixture
async def quiescent() -> Callable[..., Awaitable[None]]:
    """``await quiescent(*targets)``: each target's engine is at rest and the test left no asyncio task behind."""
    before = running_tasks()

    async def check(*targets: Any, timeout: float = 2.0) -> None:
        for target in targets:
            await assert_quiescent(target, tasks_before=before, timeout=timeout)

    return check


async def stream_until_restart(client: AsyncClient, prompt: list[int], num_tokens: int) -> tuple[int, BaseException | None]:
    """Tokens a greedy stream received, and the retryable error that ended it (None: it finished)."""
    received = 0
    try:
        async for delta in client.stream(prompt=prompt, max_tokens=num_tokens, temperature=0.0, ignore_eos=True):
            received += len(delta.token_ids)
    except EngineRestarting as exc:
        return received, exc
    return received, None
