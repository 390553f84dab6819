"""A continued run: a request re-added with the output its caller already received goes on from there."""

from __future__ import annotations

import pytest

from engine import AsyncEngine
from engine.errors import ParameterError
from tests.reliability.conftest import ENGINE_CONFIG
from tests.support.quiescence import assert_quiescent


async def test_a_continuation_goes_on_where_its_caller_stopped(model_dir) -> None:
    """``resume_token_ids`` continues a greedy run: the deltas carry only the rest, joined they equal the whole run."""
    from engine import SamplingParams

    engine = AsyncEngine(str(model_dir), **ENGINE_CONFIG)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = list(range(300, 312))
    try:
        whole = [t async for d in engine.stream(prompt, params) for t in d.token_ids]
        rest = [t async for d in engine.stream(prompt, params, resume_token_ids=whole[:8]) for t in d.token_ids]
        assert whole[:8] + rest == whole
        with pytest.raises(ParameterError) as bad:
            async for _ in engine.stream(prompt, params, resume_token_ids=[10**9]):
                pass
        assert bad.value.param == "resume_token_ids"
        await assert_quiescent(engine)
    finally:
        await engine.shutdown()
