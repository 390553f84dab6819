"""N-gram drafts (prompt lookup): the tokens that followed the last earlier occurrence of the sequence's tail.

For n from ``max_n`` down to ``min_n``, the last n tokens are looked up among the earlier tokens
(prompt and output alike); the first n that occurs proposes the up to ``k`` tokens that followed
its latest earlier occurrence. A reply that repeats a passage of its prompt (code edits,
quotations, extraction) is proposed token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(token_ids: Sequence[int] | np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``token_ids``; empty when no n-gram of its tail recurs.

    Args:
        token_ids: The sequence so far (prompt + output).
        k: Most drafts.
        max_n: Longest tail looked up.
        min_n: Shortest tail looked up.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        # NOTE: a match must end before the tail itself starts, so at least one token follows it.
        starts = _occurrences(tokens[: num - 1], tokens[num - n :])
        if len(starts):
            start = int(starts[-1]) + n
            return tokens[start : start + k].tolist()
    return []


def _occurrences(haystack: np.ndarray, needle: np.ndarray) -> np.ndarray:
    """Start indices of ``needle`` in ``haystack``, ascending (vectorised: one pass per needle token)."""
    n = len(needle)
    if len(haystack) < n:
        return np.empty(0, dtype=np.int64)
    candidates = np.flatnonzero(haystack[: len(haystack) - n + 1] == needle[0])
    for i in range(1, n):
        if not len(candidates):
            break
        candidates = candidates[haystack[candidates + i] == needle[i]]
    return candidates
