"""A ``paged serve --hook`` factory for the tests: an input filter that blocks one word."""

from __future__ import annotations

from sdk.hooks import Hook, RegexFilter

BLOCKED_WORD = "forbidden"


def make_hooks() -> list[Hook]:
    return [RegexFilter(BLOCKED_WORD, on="input")]
