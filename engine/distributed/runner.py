"""``TensorParallelRunner``: rank 0's model runner, which holds its own shard and drives the other ranks."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.distributed.communicator import START_TIMEOUT_S, Communicator
from engine.distributed.workers import WorkerGroup
from engine.errors import ModelLoadError, ParameterError, WorkerGroupFailed
from engine.parallel_state import TensorParallel, check_tensor_parallel
from engine.worker.model_runner import ModelRunner, resolve_device

logger = logging.getLogger(__name__)


class TensorParallelRunner(ModelRunner):
    """A ``ModelRunner`` for rank 0 of ``config.tensor_parallel_size`` ranks: spawns the others
    (``WorkerGroup``), sends each of them every step, runs its own shard and returns the gathered logits.
    On CPU every rank's process (this one included: ``torch.set_num_threads``) takes an equal share of the cores.

    Raises:
        ParameterError: (``tensor_parallel_size``) the model does not split over that many ranks, or (on CUDA)
            fewer GPUs are visible than ranks.
        ModelLoadError: a rank failed to load its shard.
    """

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        from transformers import AutoConfig

        size = config.tensor_parallel_size
        check_tensor_parallel(AutoConfig.from_pretrained(model_dir, local_files_only=True), size)
        device = resolve_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ParameterError(
                "tensor_parallel_size",
                f"tensor_parallel_size={size} needs a GPU per rank; {torch.cuda.device_count()} are visible",
            )
        if device.type == "cpu":  # NOTE: this process is a rank like the others: a share of the cores each
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        self.workers = WorkerGroup(config, model_dir, size)
        try:
            try:
                self.comm = Communicator(self.workers.store, 0, size, device, self.workers.timeout_s)
                super().__init__(config, model_dir, TensorParallel(0, size, self.comm))
            except RuntimeError as exc:  # joining the group, or a collective of the start-up, failed: a worker says why
                raise ModelLoadError(self.workers.start_error() or f"tensor-parallel start-up failed: {exc}") from exc
            self.workers.wait_ready(START_TIMEOUT_S)
        except BaseException:
            self.workers.close()
            raise
        logger.info("tensor parallel over %d ranks (%s)", size, "nccl" if device.type == "cuda" else "gloo")

    @property
    def all_reduce_seconds(self) -> float:
        """Time rank 0 spent in all-reduces so far (the cost of splitting the model, waits on other ranks included)."""
        return self.comm.all_reduce_seconds

    def close(self) -> None:
        """Stops the other ranks' processes."""
        self.workers.close()

    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        """Runs one step on every rank; returns rank 0's gathered logits (``ModelRunner.execute_model``).

        Raises:
            WorkerGroupFailed: a rank died or failed the step; the group is stopped and serves no more.
        """
        if not self.workers.is_alive:
            raise WorkerGroupFailed("a tensor-parallel rank is gone; the group serves no more")
        try:
            if scheduler_output.scheduled:
                self.workers.send(scheduler_output)
            return super().execute_model(scheduler_output)
        except Exception as exc:
            self.workers.close()
            raise WorkerGroupFailed(f"a tensor-parallel step failed: {exc}") from exc
