"""KV cache groups: the model's attention layers grouped by sliding window, each group with its own block table.

Logical block i of every group's table holds positions ``i * bs .. i * bs + bs - 1``. A full-attention group
reads every block of a request's context; a sliding group of window W only the blocks its window reaches, and
releases those before (``NULL_BLOCK``). What follows from the windows alone stands here: the blocks a group
reads, the longest prefix every group holds, and the most blocks a request holds at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

NULL_BLOCK = -1  # a table entry a sliding-window group released (or never took): no kernel reads it

BlockTables = tuple[list[int], ...]  # one block table per KV cache group


def blocks_per_request(
    sliding_windows: Sequence[int | None], block_size: int, num_tokens: int, max_chunk: int | None = None
) -> int:
    """The most blocks one request of ``num_tokens`` tokens holds at once over all KV cache groups, computed
    in steps of at most ``max_chunk`` tokens (None: all in one step).

    A sliding group of window W holds at most ``ceil((W - 1 + n) / bs) + 1`` blocks in a step of n
    tokens (``ceil(W / bs) + 1`` in a decode), and never more than a full-attention group.
    """
    chunk = num_tokens if max_chunk is None else min(num_tokens, max_chunk)
    full = -(-num_tokens // block_size)
    return sum(full if w is None else min(full, -(-(w - 1 + chunk) // block_size) + 1) for w in sliding_windows)


@dataclass(frozen=True, slots=True)
class KVCacheGroups:
    """The groups' sliding windows (None: full attention) over blocks of ``block_size`` tokens."""

    sliding_windows: tuple[int | None, ...]
    block_size: int

    def first_needed(self, group: int, num_tokens: int) -> int:
        """The first logical block group ``group`` reads to compute the token at position ``num_tokens``."""
        window = self.sliding_windows[group]
        return 0 if window is None else max(num_tokens - window + 1, 0) // self.block_size

    def longest_prefix(self, most: int, present: Callable[[int, int], bool]) -> int:
        """The most blocks k <= ``most`` such that every group has ``present(group, i)`` for the blocks it
        reads past them: all of 0 .. k - 1 for full attention, those of its window for a sliding group."""
        num_groups = len(self.sliding_windows)
        num_blocks, num_stable, group = most, 0, 0
        while num_stable < num_groups:  # until every group in turn keeps the count
            fewer = self._group_prefix(group, num_blocks, present)
            num_stable = num_stable + 1 if fewer == num_blocks else 1
            num_blocks, group = fewer, (group + 1) % num_groups
        return num_blocks

    def hit_tables(self, num_blocks: int, block_at: Callable[[int, int], int | None]) -> BlockTables:
        """Each group's table of the first ``num_blocks`` blocks: NULL_BLOCK before its window."""
        tables = []
        for group in range(len(self.sliding_windows)):
            first = self.first_needed(group, num_blocks * self.block_size)
            table = [NULL_BLOCK] * first + [block_at(group, i) for i in range(first, num_blocks)]
            tables.append(table)
        return tuple(tables)  # type: ignore[arg-type]  # present() held for every block taken

    def _group_prefix(self, group: int, most: int, present: Callable[[int, int], bool]) -> int:
        """The most blocks k <= ``most`` whose needed blocks group ``group`` has (see ``longest_prefix``)."""
        if self.sliding_windows[group] is None:
            k = 0
            while k < most and present(group, k):
                k += 1
            return k
        k = most
        while k > 0:  # a miss at block i rules out every k > i whose window reaches back to it
            first = self.first_needed(group, k * self.block_size)
            i = k - 1
            while i >= first and present(group, i):
                i -= 1
            if i < first:
                return k
            k = i
        return 0
