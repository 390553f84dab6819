"""Pipeline parallelism: which rank of which stage a process is, and what its stage sends to the others.

Ranks are laid out stage by stage: rank ``stage * tp + i`` is the ``i``-th tensor-parallel rank of ``stage``;
rank 0, the driver, is the first stage's first. Each rank of a stage sends its hidden states and residual
(equal on every tensor-parallel rank after the all-reduce) to the same rank of the next stage; the last stage's
first rank sends the logits to the driver, which samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.distributed.communicator import Communicator, PendingRecv
from engine.parallel_state import WHOLE, PipelineStage, TensorParallel


class PipelineLinks:
    """Rank ``rank``'s links to the stages before and after its own (``engine.parallel_state.StageLinks``), over
    ``world``, the group of every rank of every stage.

    ``wait_seconds`` adds up the time spent waiting on the previous stage's hidden states, on the next stage to take
    this one's (a send waits for the receiver to post its receive), or on the last stage's logits: the stage's idle
    time.
    """

    def __init__(self, world: Communicator, tp_size: int, pp_size: int) -> None:
        self.world, self.tp_size, self.pp_size = world, tp_size, pp_size
        self.stage, self.tp_rank = divmod(world.rank, tp_size)
        self.wait_seconds = 0.0

    def all_reduce_min(self, value: int) -> int:
        return self.world.all_reduce_min(value)

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        start = time.perf_counter()
        hidden = self.world.recv(shape, dtype, self.world.rank - self.tp_size)
        self.wait_seconds += time.perf_counter() - start
        return hidden

    def send_hidden(self, hidden: torch.Tensor) -> None:
        start = time.perf_counter()
        self.world.send(hidden, self.world.rank + self.tp_size)
        self.wait_seconds += time.perf_counter() - start

    def send_logits(self, logits: torch.Tensor) -> None:
        self.world.send(logits, 0)

    def recv_logits(self, shape: tuple[int, ...]) -> torch.Tensor:
        return self.wait_logits(self.post_logits(shape))

    def post_logits(self, shape: tuple[int, ...]) -> PendingRecv:
        """On the driver, posts the receive of a step's logits from the last stage (``wait_logits`` takes them):
        posted as the step enters the pipe, so that the last stage's send never waits on the driver, which may be
        sending it the next step's hidden states meanwhile."""
        return self.world.irecv(shape, torch.float32, (self.pp_size - 1) * self.tp_size)

    def wait_logits(self, pending: PendingRecv) -> torch.Tensor:
        start = time.perf_counter()
        logits = pending.wait()
        self.wait_seconds += time.perf_counter() - start
        return logits


def join_groups(
    store: dist.Store, rank: int, tp_size: int, layers: list[range], device: torch.device, timeout_s: float,
    failed: Callable[[], str | None] = lambda: None,
) -> tuple[TensorParallel, PipelineStage]:
    """The tensor-parallel rank and pipeline stage of global ``rank`` (``len(layers)`` stages of ``tp_size`` ranks,
    stage ``s`` holding decoder layers ``layers[s]``), their groups joined through ``store``: every rank joins the
    whole group, then its stage's own (the same order on every rank). ``failed``: ``Communicator``'s."""
    pp_size = len(layers)
    if pp_size == 1:
        comm = Communicator(store, rank, tp_size, device, timeout_s, failed=failed)
        return TensorParallel(rank, tp_size, comm), WHOLE
    world = Communicator(store, rank, tp_size * pp_size, device, timeout_s, name="world", failed=failed)
    stage, tp_rank = divmod(rank, tp_size)
    comm = Communicator(store, tp_rank, tp_size, device, timeout_s, name=f"stage{stage}") if tp_size > 1 else None
    links = PipelineLinks(world, tp_size, pp_size)
    return TensorParallel(tp_rank, tp_size, comm), PipelineStage(stage, pp_size, layers[stage], links)
