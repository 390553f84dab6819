"""Ranks meet in the group's store before the start-up collective (``Communicator.all_reduce_min``), so that a rank
slower to load its shard than the collective timeout (a busy machine) still joins, and one that failed ends the
others' wait at once with its error."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.distributed.communicator import Communicator, open_store
from engine.errors import ModelLoadError

COLLECTIVE_TIMEOUT_S = 1.0


def _pair(failed=lambda: None) -> tuple[Communicator, Communicator]:
    """Ranks 0 and 1 of one gloo group in this process, with a short collective timeout; rank 0 given ``failed``."""
    master = open_store(0, 2, is_master=True)
    worker = open_store(master.port, 2, is_master=False)
    cpu = torch.device("cpu")
    with ThreadPoolExecutor(2) as pool:  # NOTE: each rank's constructor waits for the other's
        first = pool.submit(Communicator, master, 0, 2, cpu, COLLECTIVE_TIMEOUT_S, failed=failed)
        second = pool.submit(Communicator, worker, 1, 2, cpu, COLLECTIVE_TIMEOUT_S)
        return first.result(), second.result()


def test_a_rank_later_than_the_collective_timeout_still_meets_the_others() -> None:
    rank0, rank1 = _pair()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(rank0.all_reduce_min, 7)
        time.sleep(3 * COLLECTIVE_TIMEOUT_S)  # rank 1 still loading its shard, past the collective timeout
        assert not waiting.done()
        assert rank1.all_reduce_min(5) == 5
        assert waiting.result() == 5


def test_a_rank_that_failed_while_starting_ends_the_wait_with_its_error() -> None:
    failure = threading.Event()
    rank0, _ = _pair(lambda: "rank 1 failed to load its shard: out of memory" if failure.is_set() else None)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(rank0.all_reduce_min, 7)
        failure.set()
        with pytest.raises(ModelLoadError, match="rank 1 failed to load its shard: out of memory"):
            waiting.result(timeout=60)
