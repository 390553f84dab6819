"""The rank processes of a group as Ray actors (``distributed_executor_backend="ray"``), which may sit on other
nodes: one actor per rank > 0 in one placement group, the driver (rank 0) serving the group's store on its node's
address. The group is the one the driver runs in where there is one (a Ray Serve replica's: bundle 0 is the
driver's, rank r takes bundle r), else one of a bundle per actor this group reserves. The same interface as
``workers.WorkerGroup``: each step is a call on every actor, in order (an actor runs its calls one after another),
and so is each ``RankCall`` between steps."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.distributed.communicator import open_store
from engine.distributed.rank_calls import RankCall, run_rank_call
from engine.distributed.workers import COLLECTIVE_TIMEOUT_S, WorkerSpec, build_rank
from engine.errors import KVTransferFailed, ModelLoadError, ParameterError
from engine.worker.model_runner import resolve_device

logger = logging.getLogger(__name__)


class RankActor:
    """One rank's runner inside a Ray actor (the class is wrapped by ``ray.remote`` when the group starts)."""

    def __init__(self, rank: int, spec: WorkerSpec, threads: int) -> None:
        self.rank = rank
        self.runner = build_rank(rank, spec, 0, threads)  # NOTE: Ray shows the actor its own GPU as device 0

    def where(self) -> dict[str, Any]:
        """The node this rank runs on (its id and address), its process id and its placement group's id."""
        import ray

        context = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": context.get_node_id(), "pid": os.getpid(),
                "address": ray.util.get_node_ip_address(), "placement_group_id": context.get_placement_group_id()}

    def rank_call(self, call: RankCall) -> object:
        """Runs ``call`` between steps (no collective is pending: a call that fails raises to the driver)."""
        return run_rank_call(self.runner, call)

    def step(self, step: object) -> None:
        """Runs one step; a step that fails ends the actor's process, so that the driver's collective fails at
        once (as a spawned rank's does) rather than at its timeout."""
        try:
            self.runner.execute_model(step)
        except BaseException:
            logger.exception("Ray rank %d failed a step", self.rank)
            os._exit(1)


class RayWorkerGroup:
    """Ranks 1 .. size-1 of a group as Ray actors on the Ray cluster this process is connected to (else a local one
    ``ray.init`` starts). Inside a placement group of its own (a Ray Serve replica's), rank r runs in that group's
    bundle r with the bundle's CPUs (and its GPUs on CUDA); else the group reserves one placement group of a bundle
    of ``config.ray_bundle_cpus`` CPUs, and a GPU on CUDA, per actor (``config.ray_placement_strategy``).

    Raises:
        ParameterError: (``distributed_executor_backend``) Ray is not installed; the placement group this process
            runs in has fewer bundles than the group has ranks, or on CUDA a rank's bundle has no GPU; the cluster
            cannot hold the group's own placement group within ``config.ray_placement_timeout_s`` (the bundles and
            what the cluster has free).
    """

    def __init__(self, config: EngineConfig, model_dir: Path, layers: list[range]) -> None:
        try:
            import ray
            from ray.util.placement_group import get_current_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ParameterError(
                "distributed_executor_backend", "distributed_executor_backend='ray' needs Ray: pip install 'paged[ray]'"
            ) from None
        self.size = size = config.tensor_parallel_size * len(layers)
        if not ray.is_initialized():
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
        gpu = resolve_device(config.device).type == "cuda"
        current = get_current_placement_group()
        # NOTE: a placement group nested in the one this process runs in would book its CPUs twice (and on a small
        # cluster never be held), so the ranks take the caller's bundles, as vLLM's workers do; it is not ours to
        # remove on close.
        self._owns_pg = current is None
        if current is None:
            self._pg, first = _reserve(ray, config, size - 1, gpu), 0
        else:
            _check_bundles(current.bundle_specs, size, gpu)
            self._pg, first = current, 1
        bundles = self._pg.bundle_specs[first : first + size - 1]
        host = ray.util.get_node_ip_address()
        self.store = open_store(0, size, is_master=True, host=host)
        self.timeout_s = COLLECTIVE_TIMEOUT_S
        spec = WorkerSpec(config, Path(model_dir), size, layers, self.store.port, self.timeout_s, host)
        remote = ray.remote(RankActor)
        self.actors = [
            remote.options(
                num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0) if gpu else 0.0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=first + rank - 1
                ),
            ).remote(rank, spec, max(1, int(bundle.get("CPU", 0.0))))
            for rank, bundle in enumerate(bundles, start=1)
        ]  # fmt: skip
        self._ray = ray
        self._pending: list[Any] = [actor.where.remote() for actor in self.actors]
        self.placement: list[dict[str, Any]] = []  # each actor's ``RankActor.where`` once ready
        self._closed = False

    def wait_ready(self, timeout_s: float) -> None:
        """Waits for every actor to hold its shard.

        Raises:
            ModelLoadError: an actor failed to build its shard, or did not in time.
        """
        try:
            self.placement = self._ray.get(self._pending, timeout=timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            raise ModelLoadError(f"a Ray rank did not load its shard within {timeout_s:g} s") from None
        except self._ray.exceptions.RayError as exc:
            raise ModelLoadError(f"a Ray rank failed to load its shard: {exc}") from None
        self._pending = []

    def start_error(self) -> str | None:
        """What an actor that failed while starting said (without waiting), or None."""
        done, _ = self._ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        for ref in done:
            try:
                self._ray.get(ref)
            except self._ray.exceptions.RayError as exc:
                return f"a Ray rank failed to load its shard: {exc}"
        return None

    def send(self, step: object) -> None:
        """Calls every actor's ``step`` with one step's ``SchedulerOutput`` (without waiting: the group's
        collectives meet it)."""
        for actor in self.actors:
            actor.step.remote(step)

    def call(self, calls: list[RankCall]) -> list[object]:
        """Calls each actor's ``rank_call`` (``calls[0]`` on rank 1) after the steps sent before; returns their
        answers in rank order.

        Raises:
            KVTransferFailed: an actor's call raised; or an actor died or did not answer within ``timeout_s``,
                and the group is stopped.
        """
        refs = [actor.rank_call.remote(call) for actor, call in zip(self.actors, calls, strict=True)]
        try:
            return self._ray.get(refs, timeout=self.timeout_s)
        except (self._ray.exceptions.GetTimeoutError, self._ray.exceptions.RayActorError) as exc:
            self.close()
            reason = type(exc).__name__
            raise KVTransferFailed(f"a Ray rank is gone or hangs ({reason}); the group is stopped") from None
        except self._ray.exceptions.RayError as exc:
            raise KVTransferFailed(f"a Ray rank failed {calls[0].method}: {exc}") from None

    @property
    def is_alive(self) -> bool:
        return not self._closed

    def close(self) -> None:
        """Ends every actor and removes the placement group the group reserved (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for actor in self.actors:
            self._ray.kill(actor)
        if self._owns_pg:
            self._ray.util.remove_placement_group(self._pg)


def _reserve(ray: Any, config: EngineConfig, num_bundles: int, gpu: bool) -> Any:
    """A placement group of ``num_bundles`` bundles of ``config.ray_bundle_cpus`` CPUs (and a GPU on CUDA), held.

    Raises:
        ParameterError: (``distributed_executor_backend``) the cluster did not hold it within
            ``config.ray_placement_timeout_s``.
    """
    bundle = {"CPU": config.ray_bundle_cpus, **({"GPU": 1.0} if gpu else {})}
    pg = ray.util.placement_group([dict(bundle) for _ in range(num_bundles)], strategy=config.ray_placement_strategy)
    ready, _ = ray.wait([pg.ready()], timeout=config.ray_placement_timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise ParameterError(
            "distributed_executor_backend",
            f"the Ray cluster did not hold a placement group of {num_bundles} bundles of {bundle} "
            f"({config.ray_placement_strategy}) within {config.ray_placement_timeout_s:g} s; "
            f"free now: {ray.available_resources()}",
        )
    return pg


def _check_bundles(specs: list[dict[str, float]], size: int, gpu: bool) -> None:
    """Checks that the placement group this process runs in (its bundles' ``specs``) holds ranks 1 .. size-1 in its
    bundles 1 .. size-1.

    Raises:
        ParameterError: (``distributed_executor_backend``) fewer bundles than ranks; on CUDA, a rank's bundle
            without a GPU.
    """
    if len(specs) < size:
        raise ParameterError(
            "distributed_executor_backend",
            f"this process runs in a Ray placement group of {len(specs)} bundles, fewer than the group's {size} "
            "ranks (bundle 0 is this process's, rank r takes bundle r)",
        )
    if gpu and (missing := [r for r in range(1, size) if specs[r].get("GPU", 0.0) <= 0]):
        raise ParameterError(
            "distributed_executor_backend",
            f"the Ray placement group this process runs in has no GPU in the bundles of ranks {missing} (on CUDA)",
        )
