"""Keys that rows of a batch share at the start of their contexts: how the PyTorch and CPU backends plan."""

from __future__ import annotations

import numpy as np


def common_prefix(seq_lens: np.ndarray, tables: np.ndarray, starts: np.ndarray, block_size: int) -> np.ndarray:
    """Keys every row of each group ``starts[g]:starts[g + 1]`` (consecutive rows; the last group runs to
    the end) has at the same place: the whole leading blocks all the group's tables agree on, capped at
    its shortest context."""
    sizes = np.diff(np.r_[starts, len(seq_lens)])
    same = tables == np.repeat(tables[starts], sizes, axis=0)
    run = np.logical_and.accumulate(np.logical_and.reduceat(same, starts, axis=0), axis=1).sum(1)
    # NOTE: capped at the shortest context: past it, equal ids may be table padding.
    return np.minimum(run * block_size, np.minimum.reduceat(seq_lens, starts))
