"""The rank processes of a tensor- and pipeline-parallel group: spawned by the driver (rank 0), one per rank > 0.

Each worker builds its rank's shard of the model and KV cache (a ``ModelRunner`` for its rank: its stage's layers,
its share of their heads), then runs,
step after step, the ``SchedulerOutput`` the driver sends it through its pipe: the same one the driver's
runner runs, so the collectives inside the model meet. Only the driver samples. A worker ends when its pipe
closes or sends None; a step that fails ends it (the driver's collective or receive then fails at once: the group
serves no more, and the driver stops the others).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig
from engine.distributed.communicator import arrive, open_store
from engine.distributed.pipeline import join_groups
from engine.distributed.rank_calls import RankCall, run_rank_call
from engine.errors import KVTransferFailed, ModelLoadError

if TYPE_CHECKING:
    from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0  # a collective waiting on a rank that hangs (a rank that dies is noticed at once)
_STOP_GRACE_S = 2.0


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of one group starts from: ``size`` ranks, ``len(layers)`` stages of
    ``config.tensor_parallel_size``, stage ``s`` holding decoder layers ``layers[s]``."""

    config: EngineConfig
    model_dir: Path
    size: int
    layers: list[range]
    store_port: int
    timeout_s: float
    store_host: str = "127.0.0.1"


def build_rank(rank: int, spec: WorkerSpec, device_index: int, threads: int) -> ModelRunner:
    """Rank ``rank``'s runner: its groups joined, its shard loaded (on CUDA device ``device_index``; on CPU over
    ``threads`` threads)."""
    from engine.worker.model_runner import ModelRunner, resolve_device

    device = resolve_device(spec.config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device_index)
    else:
        torch.set_num_threads(threads)
    store = open_store(spec.store_port, spec.size, is_master=False, host=spec.store_host)
    arrive(store, rank)
    tp, pp = join_groups(store, rank, spec.config.tensor_parallel_size, spec.layers, device, spec.timeout_s)
    return ModelRunner(spec.config, spec.model_dir, tp, pp)


def run_worker(rank: int, spec: WorkerSpec, conn: Connection) -> None:
    """A rank's process: build the shard, say ready (or why not), then run each step the driver sends."""
    try:  # NOTE: the ranks share the machine's cores
        runner = build_rank(rank, spec, rank, max(1, (os.cpu_count() or 1) // spec.size))
    except BaseException as exc:  # noqa: BLE001 - the driver reports it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", runner.num_blocks))
    while True:
        try:
            step = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            return
        if step is None:
            return
        if isinstance(step, RankCall):  # NOTE: no collective is pending: a failed call is answered, not fatal
            try:
                answer = ("ok", run_rank_call(runner, step))
            except Exception as exc:  # noqa: BLE001 - the driver reports it
                logger.error("rank %d failed %s:\n%s", rank, step.method, traceback.format_exc())
                answer = ("error", f"{type(exc).__name__}: {exc}")
            conn.send(answer)
            continue
        try:
            runner.execute_model(step)
        except BaseException:
            logger.error("rank %d failed a step:\n%s", rank, traceback.format_exc())
            raise


class WorkerGroup:
    """Ranks 1 .. size-1 of a group, each in a process of its own (``spawn``), and the group's store.

    Args:
        config: the engine's settings; every rank builds its shard from them.
        model_dir: the model every rank loads its shard of.
        layers: each pipeline stage's decoder layers (one range: no pipeline).
    """

    def __init__(self, config: EngineConfig, model_dir: Path, layers: list[range]) -> None:
        self.size = size = config.tensor_parallel_size * len(layers)
        self.store = open_store(0, size, is_master=True)
        self.timeout_s = COLLECTIVE_TIMEOUT_S
        spec = WorkerSpec(config, Path(model_dir), size, layers, self.store.port, self.timeout_s)
        context = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_worker, args=(rank, spec, theirs), name=f"paged-rank-{rank}", daemon=True
            )
            process.start()
            theirs.close()
            self._conns.append(ours)
            self.processes.append(process)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._conns)

    def wait_ready(self, timeout_s: float) -> None:
        """Waits for every worker to hold its shard.

        Raises:
            ModelLoadError: a worker failed to build its shard, or ended, or did not answer in time.
        """
        for rank, conn in enumerate(self._conns, 1):
            if not conn.poll(timeout_s):
                raise ModelLoadError(f"rank {rank} did not load its shard within {timeout_s:g} s")
            try:
                status, detail = conn.recv()
            except (EOFError, OSError):
                raise ModelLoadError(f"rank {rank} ended while loading its shard") from None
            if status == "error":
                raise ModelLoadError(f"rank {rank} failed to load its shard: {detail}")

    def start_error(self) -> str | None:
        """What a worker that failed while starting said (without waiting), or None."""
        for rank, conn in enumerate(self._conns, 1):
            try:
                if conn.poll(0):
                    status, detail = conn.recv()
                    if status == "error":
                        return f"rank {rank} failed to load its shard: {detail}"
            except (EOFError, OSError):
                return f"rank {rank} ended while loading its shard"
        return None

    def send(self, step: object) -> None:
        """Sends one step's ``SchedulerOutput`` to every worker.

        Raises:
            OSError: a worker's pipe is closed (it died).
        """
        for conn in self._conns:
            conn.send(step)

    def call(self, calls: list[RankCall]) -> list[object]:
        """Sends each worker its call (``calls[0]`` to rank 1) and returns their answers, in rank order, once all
        have answered.

        Raises:
            KVTransferFailed: a worker's call raised (named with its rank); or a worker ended or did not answer
                within ``timeout_s``, and the group is stopped (a late answer would be taken for the next call's).
        """
        errors: list[str] = []
        answers: list[object] = []
        try:
            for conn, call in zip(self._conns, calls, strict=True):
                conn.send(call)
            for rank, conn in enumerate(self._conns, 1):
                if not conn.poll(self.timeout_s):
                    raise TimeoutError(f"rank {rank} did not answer within {self.timeout_s:g} s")
                status, value = conn.recv()
                if status == "error":
                    errors.append(f"rank {rank}: {value}")
                answers.append(value)
        except (OSError, EOFError, TimeoutError) as exc:
            self.close()
            reason = str(exc) or type(exc).__name__
            raise KVTransferFailed(f"a rank is gone or hangs ({reason}); the group is stopped") from None
        if errors:
            raise KVTransferFailed("; ".join(errors))
        return answers

    @property
    def is_alive(self) -> bool:
        return self._finalizer.alive and all(p.is_alive() for p in self.processes)

    def close(self) -> None:
        """Stops every worker (idempotent; also when the group is garbage collected)."""
        self._finalizer()


def _stop(processes: list[multiprocessing.process.BaseProcess], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
        conn.close()
    for process in processes:
        process.join(_STOP_GRACE_S)
        if process.is_alive():  # NOTE: stuck in a collective of a group that failed
            process.kill()
            process.join()
