"""The driver's calls on the other ranks' runners between steps, through the channel that carries the steps.

Persisted KV blocks (``kv_cache_dir``): the driver's ``PersistedKVCache`` decides which blocks load and save, as
with one process; each rank moves its own shard's K/V (its stage's layers, its KV heads) in and out of its cache,
and the driver joins the ranks' parts of a block into one payload (``engine.core.kv_layout``), one file per block.
So a block file holds every rank's part under one checksum, whichever node a rank runs on, and a block is restored
on every rank or on none. And each pipeline stage's idle time so far (``stage_wait_seconds``), for benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.worker.model_runner import ModelRunner

# NOTE: the runner methods a call may name: KV blocks and counters, never a step
RANK_METHODS = frozenset({"kv_shard", "read_kv_blocks", "write_kv_blocks", "stage_wait_seconds"})


@dataclass(frozen=True)
class RankCall:
    """A call of ``method`` (one of ``RANK_METHODS``) on a rank's ``ModelRunner`` with ``args``, sent beside the
    steps (in order with them); the rank answers with what it returns."""

    method: str
    args: tuple[object, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.method not in RANK_METHODS:
            raise ValueError(f"a rank call names one of {sorted(RANK_METHODS)}, not {self.method!r}")


def run_rank_call(runner: ModelRunner, call: RankCall) -> object:
    """``call`` run on a rank's runner: its return value."""
    return getattr(runner, call.method)(*call.args)
