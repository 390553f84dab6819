"""``ParallelRunner``: rank 0's model runner, which holds its own shard and drives the other ranks."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

from engine.config import EngineConfig
from engine.core.kv_layout import KVLayout, split_payload
from engine.core.scheduler_output import SchedulerOutput
from engine.distributed.communicator import START_TIMEOUT_S, PendingRecv, wait_for_ranks
from engine.distributed.pipeline import PipelineLinks, join_groups
from engine.distributed.rank_calls import RankCall
from engine.distributed.workers import WorkerGroup
from engine.errors import KVTransferFailed, ModelLoadError, ParameterError, WorkerGroupFailed
from engine.parallel_state import check_pipeline_parallel, check_tensor_parallel, stage_layers
from engine.worker.model_runner import ModelRunner, resolve_device

logger = logging.getLogger(__name__)

_KV_BATCH = 64  # blocks a read asks each rank for at a time (one message each way)


class ParallelRunner(ModelRunner):
    """A ``ModelRunner`` for rank 0 of ``tensor_parallel_size x pipeline_parallel_size`` ranks: spawns the others
    (``WorkerGroup``), sends each of them every step, runs its own shard (the first stage's layers, its share of
    their heads) and returns the logits (gathered over its stage, or the last stage's). On CPU every rank's
    process (this one included: ``torch.set_num_threads``) takes an equal share of the cores.

    Under a pipeline, ``submit`` sends a step in and ``collect`` takes the oldest step's logits, so that several steps
    are in the pipe at once (``engine.step_pipeline``); ``execute_model`` runs one step through the whole pipe.

    Persisted KV blocks (``kv_cache_dir``) move in and out of every rank's cache: a block's payload is every rank's
    part in rank order (``engine.distributed.rank_calls``), its layout the group's split (``KVLayout.shards``).

    Raises:
        ParameterError: (``tensor_parallel_size``) the model does not split over that many ranks, or (on CUDA)
            fewer GPUs are visible than ranks; (``pipeline_parallel_size``, ``pipeline_layer_partition``) its
            layers do not split into the stages.
        ModelLoadError: a rank failed to load its shard.
    """

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        from transformers import AutoConfig

        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        check_tensor_parallel(hf_config, tp_size)
        check_pipeline_parallel(hf_config, pp_size)
        text_config = hf_config.get_text_config()
        layers = stage_layers(text_config.num_hidden_layers, pp_size, config.pipeline_layer_partition)
        size = tp_size * pp_size
        device = resolve_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ParameterError(
                "tensor_parallel_size" if pp_size == 1 else "pipeline_parallel_size",
                f"{tp_size} x {pp_size} ranks need a GPU each; {torch.cuda.device_count()} are visible",
            )
        if device.type == "cpu":  # NOTE: this process is a rank like the others: a share of the cores each
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        self.kind = "tensor-parallel" if pp_size == 1 else "pipeline-parallel"
        self._layout: KVLayout | None = None  # the group's, once asked (kv_layout)
        # each step submitted and not collected yet: its logits' posted receive (None: a step without logits)
        self._in_flight: deque[PendingRecv | None] = deque()
        self.max_steps_in_flight = 0  # the most steps in the pipe at once so far (submit)
        if config.distributed_executor_backend == "ray":
            from engine.distributed.ray_workers import RayWorkerGroup

            self.workers: WorkerGroup | RayWorkerGroup = RayWorkerGroup(config, model_dir, layers)
        else:
            self.workers = WorkerGroup(config, model_dir, layers)
        try:
            try:
                wait_for_ranks(self.workers.store, size, self.workers.start_error)
                tp, pp = join_groups(
                    self.workers.store, 0, tp_size, layers, device, self.workers.timeout_s, self.workers.start_error
                )
                self.comm = tp.comm
                super().__init__(config, model_dir, tp, pp)
            except RuntimeError as exc:  # joining the group, or a collective of the start-up, failed: a worker says why
                raise ModelLoadError(self.workers.start_error() or f"{self.kind} start-up failed: {exc}") from exc
            self.workers.wait_ready(START_TIMEOUT_S)
        except BaseException:
            self.workers.close()
            raise
        logger.info(
            "%d tensor-parallel ranks x %d pipeline stages (layers %s; %s)", tp_size, pp_size,
            ", ".join(f"{r.start}-{r.stop - 1}" for r in layers), "nccl" if device.type == "cuda" else "gloo",
        )  # fmt: skip

    @property
    def all_reduce_seconds(self) -> float:
        """Time rank 0 spent in all-reduces so far (the cost of splitting the model, waits on other ranks included)."""
        return 0.0 if self.comm is None else self.comm.all_reduce_seconds

    def stage_wait_seconds_per_stage(self) -> list[float]:
        """Each pipeline stage's idle time so far (its first tensor-parallel rank's ``stage_wait_seconds``: waiting
        on the stage before, on the next to take its hidden states, and on the driver for the logits), stage 0
        first. A call between steps: the other ranks answer once they finished the steps sent before.

        Raises:
            WorkerGroupFailed: a rank is gone or did not answer.
        """
        try:
            others = self._call_ranks(lambda rank: RankCall("stage_wait_seconds"))
        except KVTransferFailed as exc:
            raise WorkerGroupFailed(f"a {self.kind} rank did not say its idle time: {exc}") from exc
        waits = [self.stage_wait_seconds(), *others]
        return [float(waits[stage * self.tp.size]) for stage in range(self.pp.size)]

    def close(self) -> None:
        """Stops the other ranks' processes."""
        self.workers.close()

    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        """Runs one step on every rank; returns the driver's logits (``ModelRunner.execute_model``).

        Raises:
            WorkerGroupFailed: a rank died or failed the step; the group is stopped and serves no more.
        """
        if not self.workers.is_alive:
            raise WorkerGroupFailed(f"a {self.kind} rank is gone; the group serves no more")
        try:
            if scheduler_output.scheduled:
                self.workers.send(scheduler_output)
            return super().execute_model(scheduler_output)
        except Exception as exc:
            self._fail(exc)

    # ------------------------------------------------------------------------------------ steps in flight

    @property
    def num_steps_in_flight(self) -> int:
        """Steps ``submit`` sent into the pipe whose logits ``collect`` has not taken yet."""
        return len(self._in_flight)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Sends a step into the pipeline without waiting for its logits: every rank gets it, this rank runs the
        first stage's layers on it and hands its hidden states on, and the receive of its logits is posted.
        ``collect`` takes them, steps in the order they were submitted. Pipeline stages only (not the last).

        Raises:
            WorkerGroupFailed: a rank died or failed a step; the group is stopped and serves no more.
        """
        if not self.workers.is_alive:
            raise WorkerGroupFailed(f"a {self.kind} rank is gone; the group serves no more")
        assert isinstance(self.pp.links, PipelineLinks) and not self.pp.is_last
        pending = None
        try:
            if scheduler_output.scheduled:
                self.workers.send(scheduler_output)
                rows = self.run_stage(scheduler_output)
                pending = self.pp.links.post_logits((rows, self.vocab_size)) if rows else None
        except Exception as exc:
            self._fail(exc)
        self._in_flight.append(pending)
        self.max_steps_in_flight = max(self.max_steps_in_flight, len(self._in_flight))

    def collect(self) -> torch.Tensor:
        """The logits ``[rows, vocab]`` (float32) of the oldest step ``submit`` sent, once they arrive.

        Raises:
            WorkerGroupFailed: a rank died or failed a step; the group is stopped and serves no more.
        """
        pending = self._in_flight.popleft()
        if pending is None:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        try:
            return self.pp.links.wait_logits(pending)
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> NoReturn:
        self._in_flight.clear()
        self.workers.close()
        raise WorkerGroupFailed(f"a {self.kind} step failed: {exc}") from exc

    # ------------------------------------------------------------------------------------ persistence

    def kv_layout(self) -> KVLayout:
        """The group's layout: rank 0's, with every rank's part of a block (``KVLayout.shards``).

        Raises:
            KVTransferFailed: a rank did not say its part.
        """
        shards = (self.kv_shard(), *self._call_ranks(lambda rank: RankCall("kv_shard")))
        self._layout = dataclasses.replace(super().kv_layout(), shards=shards)
        return self._layout

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's payload: every rank's K and V of its layers and heads (``ModelRunner.read_kv_blocks``),
        joined in rank order.

        Raises:
            KVTransferFailed: a rank did not give its part (nothing is returned).
        """
        payloads: list[bytes] = []
        for start in range(0, len(block_ids), _KV_BATCH):
            batch = block_ids[start : start + _KV_BATCH]
            parts = self._call_ranks(lambda rank: RankCall("read_kv_blocks", (batch,)))
            own = super().read_kv_blocks(batch)
            payloads += [b"".join(block) for block in zip(own, *parts, strict=True)]
        return payloads

    def write_kv_blocks(self, block_ids: list[int], payloads: list[bytes | memoryview]) -> None:
        """Writes ``read_kv_blocks``' payloads back: each rank its part of each block.

        Raises:
            KVTransferFailed: a rank did not take its part: the blocks hold no valid K/V (on some ranks).
        """
        if not block_ids:
            return
        layout = self._layout if self._layout is not None else self.kv_layout()
        try:
            per_rank = list(zip(*(split_payload(p, layout.shard_bytes) for p in payloads), strict=True))
        except ValueError as exc:
            raise KVTransferFailed(str(exc)) from None
        self._call_ranks(lambda rank: RankCall("write_kv_blocks", (block_ids, [bytes(p) for p in per_rank[rank]])))
        super().write_kv_blocks(block_ids, list(per_rank[0]))

    def _call_ranks(self, call_for: Callable[[int], RankCall]) -> list[object]:
        """Every other rank's answer to its ``call_for(rank)``, in rank order (``WorkerGroup.call``)."""
        if not self.workers.is_alive:
            raise KVTransferFailed(f"a {self.kind} rank is gone; the group serves no more")
        return self.workers.call([call_for(rank) for rank in range(1, self.workers.size)])
