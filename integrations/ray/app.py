"""The Ray Serve application: an ``Ingress`` over ``EngineReplica`` replicas routed by ``PrefixAffinityRouter``.

``build_app(args, make_app)`` takes the ``paged serve`` flags (``--replicas``, ``--routing``,
``--replica-cpus``, ``--replica-gpus`` and every server and engine flag) and the function that
builds ``paged serve``'s application from them; ``integrations.ray.config`` has the entry for
Serve config files.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from engine.config import EngineConfig
from integrations.engine_flags import engine_config
from integrations.ray.ingress import Ingress
from integrations.ray.replica import EngineReplica

APP_NAME = "paged"
# NOTE: routers by import path: Serve imports them where the handles are (a class would be pickled by value).
PREFIX_ROUTER = "integrations.ray.router.PrefixAffinityRouter"
ROUND_ROBIN_ROUTER = "ray.serve.experimental.round_robin_router.RoundRobinRouter"  # the contrast baseline
ROUTING_STATS_PERIOD = 2.0  # seconds between a replica's reports of the prefixes it caches
ONGOING_PER_SEQ = 4  # a replica takes up to this many requests per engine sequence slot (the rest queue in Ray)
INGRESS_CPUS = 0.25  # the ingress hashes prompts and relays bytes
# NOTE: Serve notices a dead replica at its next health check (its default period is 10 s) and only then starts
# the replacement, whose model load is most of the gap; a check reads the server's phase and costs nothing.
HEALTH_CHECK_PERIOD = 2.0  # seconds
REPLICA_STOP_MARGIN = 5.0  # seconds a stopping replica gets beyond its server's --drain-timeout


def replica_resources(cpus: float, gpus: float, config: EngineConfig) -> dict[str, Any]:
    """A replica's Ray Serve resource options: ``cpus`` and ``gpus`` per rank of ``config``. A replica of several
    ranks (tensor parallel x pipeline stages) is one placement group of a bundle per rank, the replica's actor
    taking the first bundle and rank r bundle r: packed on one node (``STRICT_PACK``) where its ranks are processes
    the replica spawns, placed by ``config.ray_placement_strategy`` where they are Ray actors (which then run in the
    replica's group rather than in one of their own)."""
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    strategy = config.ray_placement_strategy if config.distributed_executor_backend == "ray" else "STRICT_PACK"
    actor = {"num_cpus": cpus, "num_gpus": gpus}
    if ranks == 1:
        return {"ray_actor_options": actor}
    bundle = {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}
    return {
        "ray_actor_options": actor,
        "placement_group_bundles": [dict(bundle) for _ in range(ranks)],
        "placement_group_strategy": strategy,
    }


def build_app(args: argparse.Namespace, make_app: Callable[[argparse.Namespace], web.Application]) -> Application:
    """The fleet for ``args``: ``args.replicas`` engine replicas, each serving ``make_app(args)``, behind one ingress.

    Raises:
        FlagError: an engine flag the config refuses.
    """
    config = engine_config(args)
    max_ongoing = ONGOING_PER_SEQ * config.max_num_seqs
    router = PREFIX_ROUTER if args.routing == "prefix" else ROUND_ROBIN_ROUTER
    replica = serve.deployment(
        EngineReplica,
        name="engine",
        num_replicas=args.replicas or 1,
        max_ongoing_requests=max_ongoing,
        **replica_resources(args.replica_cpus, args.replica_gpus, config),
        request_router_config=RequestRouterConfig(
            request_router_class=router, request_routing_stats_period_s=ROUTING_STATS_PERIOD
        ),
        graceful_shutdown_timeout_s=args.drain_timeout + REPLICA_STOP_MARGIN,
        health_check_period_s=HEALTH_CHECK_PERIOD,
    )
    ingress = serve.deployment(
        Ingress,
        name="ingress",
        max_ongoing_requests=max_ongoing * (args.replicas or 1),
        ray_actor_options={"num_cpus": INGRESS_CPUS},
        # NOTE: the ingress relays the replicas' streams: it stops after them, so a stream a draining replica
        # finishes (or ends with its journal's answer) reaches its client rather than a cut connection.
        graceful_shutdown_timeout_s=args.drain_timeout + 2 * REPLICA_STOP_MARGIN,
    )
    return ingress.bind(replica.bind(args, make_app), args)

