"""Ranks as Ray actors (``distributed_executor_backend="ray"``) on a local two-node Ray cluster this test starts:
a head node without CPUs for actors and a second raylet with two CPUs and a resource label of its own. pp=2 puts
its second stage on the second node and gives transformers' greedy tokens; a killed stage actor fails the requests
with a typed error and returns every block; a placement group the cluster cannot hold fails start-up by its
deadline, naming the bundles; the stage on the second node saves and loads its layers of a persisted prefix; an
engine inside a placement group (as in a Serve replica) puts its ranks in that group's bundles."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from engine import Engine, SamplingParams
from engine.errors import ParameterError, WorkerGroupFailed
from tests.engine.distributed.test_pipeline_parallel import (
    GREEDY,
    MODELS,
    PROMPTS,
    _assert_alone_and_batched,
    _hf_greedy,
)
from tests.engine.test_kv_cache_dir import CONFIG, QUESTIONS, SYSTEM, answer, assert_pool_whole

ray = pytest.importorskip("ray")
OPTIONS = dict(dtype="float32", device="cpu", block_size=4, num_blocks=96, distributed_executor_backend="ray")


def _free_cpus_become(expected: float, timeout_s: float = 30.0) -> bool:
    """Whether the cluster's free CPUs reach ``expected`` within ``timeout_s`` (resources are returned
    asynchronously; the view is polled)."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU") != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _replica_in(pg: Any) -> Any:
    """What a Serve replica is, without Serve: an actor of one CPU in ``pg``'s bundle 0, its children captured. Its
    class is defined here so that Ray carries it by value (the workers do not import the tests)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    class Replica:
        def start(self, model: str, options: dict[str, Any]) -> None:
            """Builds the engine (an error it raises reaches the caller as itself, fields and all)."""
            self.engine = Engine(model, **options)

        def generate(self, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
            """The greedy tokens, the ranks' placement, and the placement groups alive: this actor's and all."""
            outputs = self.engine.generate(prompts, params, use_tqdm=False)
            table = ray.util.placement_group_table()
            return {
                "tokens": [o.outputs[0].token_ids for o in outputs],
                "placement": self.engine.runner.workers.placement,
                "own_group": ray.util.get_current_placement_group().id.hex(),
                "live_groups": sorted(pg_id for pg_id, group in table.items() if group["state"] != "REMOVED"),
            }

        def close(self) -> None:
            self.engine.close()

    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0,
                                                placement_group_capture_child_tasks=True)  # fmt: skip
    return ray.remote(num_cpus=1)(Replica).options(scheduling_strategy=strategy).remote()


@pytest.fixture(scope="module")
def two_nodes():
    """A head node (no CPUs: nothing is placed there) and a second node labelled ``second_node``; the driver
    (this process) connects to it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    second = cluster.add_node(num_cpus=2, resources={"second_node": 1})
    ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        yield second.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.parametrize("arch", MODELS)
def test_a_stage_on_the_second_node_gives_transformers_greedy_tokens(arch, two_nodes, tiny_model_factory) -> None:
    """pp=2 on Ray: rank 1 (the last stage) runs on the second node; the tokens equal transformers', alone and
    batched with prefix caching on; closing the engine ends the actor."""
    model_dir = tiny_model_factory(arch)
    with Engine(str(model_dir), pipeline_parallel_size=2, **OPTIONS) as engine:
        [where] = engine.runner.workers.placement
        assert where["rank"] == 1 and where["node_id"] == two_nodes
        assert ray.available_resources().get("second_node") == 1  # a label, not reserved by the bundle
        _assert_alone_and_batched(engine, _hf_greedy(model_dir, PROMPTS))
    assert _free_cpus_become(2.0)  # the bundle given back


def test_a_placement_group_the_cluster_cannot_hold_fails_by_its_deadline(two_nodes, tiny_model_factory) -> None:
    """pp=2 x tp=2 asks three bundles of one CPU of a cluster with two: a ParameterError naming the bundles, after
    ``ray_placement_timeout_s``, and the cluster's CPUs free again."""
    with pytest.raises(ParameterError, match=r"placement group of 3 bundles of \{'CPU': 1.0\}") as err:
        Engine(str(tiny_model_factory("llama")), pipeline_parallel_size=2, tensor_parallel_size=2,
               ray_placement_timeout_s=3.0, **OPTIONS)  # fmt: skip
    assert err.value.param == "distributed_executor_backend"
    assert _free_cpus_become(2.0)


def test_a_killed_stage_actor_fails_every_request_and_returns_every_block(two_nodes, tiny_model_factory) -> None:
    """The last stage's actor killed mid-generation: the next step raises WorkerGroupFailed, every request fails
    with it, the pool is whole, and the placement group's CPUs come back."""
    engine = Engine(str(tiny_model_factory("llama")), pipeline_parallel_size=2, **OPTIONS)
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(None, p, params) for p in PROMPTS]
        engine.step()
        ray.kill(engine.runner.workers.actors[0])
        with pytest.raises(WorkerGroupFailed, match="pipeline-parallel step failed"):
            while engine.has_unfinished_requests():
                engine.step()
        failures = engine.pop_failures()
        assert sorted(failures) == sorted(ids) and all(isinstance(e, WorkerGroupFailed) for e in failures.values())
        engine.kv.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        assert not engine.runner.workers.is_alive
    finally:
        engine.close()
    assert _free_cpus_become(2.0)


def test_a_persisted_prefix_is_saved_and_loaded_through_the_actors(two_nodes, tiny_model_factory, tmp_path) -> None:
    """pp=2 on Ray with kv_cache_dir: the first engine pins SYSTEM and saves on close, its last stage's layers
    coming from the actor on the second node; a second engine loads them into both stages and serves the
    questions from the cache with the first engine's tokens."""
    model_dir = str(tiny_model_factory("llama"))
    options = {**OPTIONS, **CONFIG, "pipeline_parallel_size": 2, "kv_cache_dir": tmp_path}
    options["kv_cache_save_hot_blocks"] = 0
    with Engine(model_dir, **options) as first:
        first.pin_prefix(SYSTEM)
        expected, _ = answer(first, QUESTIONS)
    assert len(list(tmp_path.rglob("*.kvb"))) == 10
    with Engine(model_dir, **options) as second:
        assert answer(second, QUESTIONS) == (expected, [40, 40, 40])
        assert_pool_whole(second)


def test_an_engine_inside_a_placement_group_puts_its_ranks_in_its_bundles(two_nodes, tiny_model_factory) -> None:
    """pp=2 on Ray from an actor in bundle 0 of a placement group of the cluster's two CPUs (a Serve replica's
    shape): rank 1 runs in the group's bundle 1 and no group of its own is made (one could not be held), the
    tokens equal transformers', and the group outlives the engine's close (it is not the engine's to remove)."""
    model_dir = tiny_model_factory("llama")
    pg = ray.util.placement_group([{"CPU": 1.0}, {"CPU": 1.0}])
    ray.get(pg.ready(), timeout=60)
    replica = _replica_in(pg)
    try:
        options = {**OPTIONS, "pipeline_parallel_size": 2, "ray_placement_timeout_s": 5.0}
        assert ray.get(replica.start.remote(str(model_dir), options), timeout=600) is None
        seen = ray.get(replica.generate.remote(PROMPTS, GREEDY), timeout=600)
        ray.get(replica.close.remote(), timeout=60)
        [where] = seen["placement"]
        assert where["rank"] == 1 and where["node_id"] == two_nodes
        assert where["placement_group_id"] == seen["own_group"] == pg.id.hex()
        assert seen["live_groups"] == [pg.id.hex()]
        assert seen["tokens"] == _hf_greedy(model_dir, PROMPTS)
        assert ray.util.placement_group_table(pg)["state"] == "CREATED"
    finally:
        ray.kill(replica)
        ray.util.remove_placement_group(pg)
    assert _free_cpus_become(2.0)


def test_a_placement_group_of_fewer_bundles_than_ranks_is_refused(two_nodes, tiny_model_factory) -> None:
    """pp=2 x tp=2 (four ranks) from inside a placement group of two bundles: a ParameterError naming both."""
    pg = ray.util.placement_group([{"CPU": 1.0}, {"CPU": 1.0}])
    ray.get(pg.ready(), timeout=60)
    replica = _replica_in(pg)
    try:
        options = {**OPTIONS, "pipeline_parallel_size": 2, "tensor_parallel_size": 2}
        with pytest.raises(ParameterError, match="placement group of 2 bundles, fewer than the group's 4 ranks") as err:
            ray.get(replica.start.remote(str(tiny_model_factory("llama")), options), timeout=600)
        assert err.value.param == "distributed_executor_backend"
    finally:
        ray.kill(replica)
        ray.util.remove_placement_group(pg)
    assert _free_cpus_become(2.0)
