"""The collectives of one tensor-parallel group: gloo on CPU, NCCL on CUDA, over a TCP store on localhost.

A ``Communicator`` holds its own process group object rather than ``torch.distributed``'s default group, so
one process may hold several groups over its life (an engine restarted with fresh workers) or at once.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from engine.errors import ModelLoadError

START_TIMEOUT_S = 300.0  # ranks joining the group (each loads its shard meanwhile)


class Communicator:
    """Rank ``rank`` of ``size`` in a group that ``store`` (a ``torch.distributed.TCPStore``) introduces.

    Args:
        name: tells apart the groups one store introduces (a pipeline's whole group, each stage's own).
        timeout_s: how long a collective waits for a rank before it raises (a rank that died is noticed at
            once, its connections closed; the timeout bounds a rank that hangs).
        failed: says why a rank ended while starting (None: none did), so that the start-up meeting
            (``all_reduce_min``) ends at once rather than at its deadline (rank 0 passes its workers').

    ``all_reduce_seconds`` adds up the time spent in ``all_reduce`` (what a step pays for splitting the model).
    """

    def __init__(
        self, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float, name: str = "",
        failed: Callable[[], str | None] = lambda: None,
    ) -> None:  # fmt: skip
        self.rank, self.size, self.device = rank, size, device
        self._meeting = dist.PrefixStore(f"{name}meet", store)
        self._failed = failed
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(dist.PrefixStore(f"{name}nccl", store), rank, size, options)
        else:
            self._group = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}gloo", store), rank, size, timeout)
        self.all_reduce_seconds = 0.0
        self.num_all_reduces = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place."""
        start = time.perf_counter()
        self._group.allreduce([x]).wait()
        self.all_reduce_seconds += time.perf_counter() - start
        self.num_all_reduces += 1
        return x

    def all_reduce_min(self, value: int) -> int:
        """The least of each rank's ``value``; at start-up, once each rank loaded its shard (the KV blocks every rank
        fits). The ranks first meet in the store, up to START_TIMEOUT_S: on a busy machine a rank may take longer
        than the collective timeout to load its shard.

        Raises:
            ModelLoadError: a rank failed to start, or did not come in time.
        """
        self._meeting.set(f"sized/{self.rank}", "1")
        _wait_for_keys(self._meeting, [f"sized/{rank}" for rank in range(self.size)], self._failed)
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._group.allreduce([x], options).wait()
        return int(x.item())

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """On rank 0, every rank's ``x`` side by side along the last dimension (rank order); None elsewhere."""
        x = x.contiguous()
        outputs = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._group.gather(outputs, [x], options).wait()
        return torch.cat(outputs[0], dim=-1) if self.rank == 0 else None

    def send(self, x: torch.Tensor, peer: int) -> None:
        """``x`` to rank ``peer``, which receives it with ``recv``."""
        self._group.send([x.contiguous()], peer, 0).wait()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` that rank ``peer`` sends."""
        return self.irecv(shape, dtype, peer).wait()

    def irecv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int) -> PendingRecv:
        """Posts the receive of a tensor of ``shape`` and ``dtype`` that rank ``peer`` sends, without waiting: the
        peer's ``send`` (which waits for a posted receive) completes while this rank does other work."""
        x = torch.empty(shape, dtype=dtype, device=self.device)
        return PendingRecv(self._group.recv([x], peer, 0), x)


class PendingRecv(NamedTuple):
    """A posted receive (``Communicator.irecv``): ``wait()`` gives its tensor once it arrived."""

    work: dist.Work
    tensor: torch.Tensor

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor


def open_store(port: int, size: int, is_master: bool, host: str = "127.0.0.1") -> dist.TCPStore:
    """The group's store on ``host`` (the driver's address; localhost where every rank is on its machine): rank 0
    serves it (``port`` 0: a free one, then ``store.port``)."""
    return dist.TCPStore(
        host, port, size, is_master, timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
        wait_for_workers=False,
    )  # fmt: skip


def arrive(store: dist.Store, rank: int) -> None:
    """Says in the group's store that ``rank`` started and is about to join its groups (``wait_for_ranks``)."""
    store.set(f"arrived/{rank}", "1")


def wait_for_ranks(store: dist.Store, size: int, failed: Callable[[], str | None]) -> None:
    """Waits until ranks 1 .. ``size`` - 1 have arrived, up to START_TIMEOUT_S.

    Joining a group waits only the collective timeout for the others, and a rank's process (spawned, or a Ray
    worker) can take longer than that to start on a busy machine; so rank 0 joins once all have arrived.
    ``failed()`` says why a rank ended while starting (None: none did), so that such a rank ends the wait at once.

    Raises:
        ModelLoadError: a rank failed to start, or did not arrive in time.
    """
    _wait_for_keys(store, [f"arrived/{rank}" for rank in range(1, size)], failed)


def _wait_for_keys(store: dist.Store, keys: list[str], failed: Callable[[], str | None]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not store.check(keys):
        if (error := failed()) is not None:
            raise ModelLoadError(error)
        if time.monotonic() > deadline:
            raise ModelLoadError(f"the ranks did not start within {START_TIMEOUT_S:g} s")
        time.sleep(0.05)
