"""Structured output's acceptance on the bundled model, in process: 100 extraction prompts, every reply valid."""

from __future__ import annotations

from sdk import AsyncClient
from tests.support.extraction import MAX_TOKENS, PROMPTS, SCHEMA_MODEL, messages, validate


async def test_every_extraction_reply_validates() -> None:
    """All 100 prompts, batched on one engine and greedy, finish with "stop" and validate against the schema."""
    client = AsyncClient()
    try:
        results = await client.batch(
            [messages(p) for p in PROMPTS], response_format=SCHEMA_MODEL, max_tokens=MAX_TOKENS, temperature=0.0
        )
    finally:
        await client.aclose()
    assert [r.finish_reason for r in results] == ["stop"] * len(PROMPTS)
    for result in results:
        assert validate(result.text) == result.parsed
