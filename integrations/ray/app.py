"""The Ray Serve application: an ``Ingress`` over ``EngineReplica`` replicas routed by ``PrefixAffinityRouter``.

``build_app(args)`` takes the ``paged serve`` flags (``--replicas``, ``--routing``,
``--replica-cpus``, ``--replica-gpus`` and every server and engine flag). ``app_builder`` is the
same for ``serve run`` / ``serve deploy`` configs, whose ``args`` are those flags as a mapping::

    applications:
      - name: paged
        route_prefix: /
        import_path: integrations.ray.app:app_builder
        args: {replicas: 2, model: /models/qwen, api_key: [sk-1], max_num_seqs: 64}
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from integrations.engine_flags import engine_config
from integrations.ray.ingress import Ingress
from integrations.ray.replica import EngineReplica
from integrations.ray.router import PrefixAffinityRouter

APP_NAME = "paged"
ROUND_ROBIN_ROUTER = "ray.serve.experimental.round_robin_router.RoundRobinRouter"  # the contrast baseline
ROUTING_STATS_PERIOD = 2.0  # seconds between a replica's reports of the prefixes it caches
ONGOING_PER_SEQ = 4  # a replica takes up to this many requests per engine sequence slot (the rest queue in Ray)
INGRESS_CPUS = 0.25  # the ingress hashes prompts and relays bytes


def build_app(args: argparse.Namespace) -> Application:
    """The fleet for ``args``: ``args.replicas`` engine replicas behind one ingress.

    Raises:
        FlagError: an engine flag the config refuses.
    """
    config = engine_config(args)
    max_ongoing = ONGOING_PER_SEQ * config.max_num_seqs
    router = PrefixAffinityRouter if args.routing == "prefix" else ROUND_ROBIN_ROUTER
    replica = serve.deployment(
        EngineReplica,
        name="engine",
        num_replicas=args.replicas or 1,
        max_ongoing_requests=max_ongoing,
        ray_actor_options={"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus},
        request_router_config=RequestRouterConfig(
            request_router_class=router, request_routing_stats_period_s=ROUTING_STATS_PERIOD
        ),
        graceful_shutdown_timeout_s=args.drain_timeout + 5.0,
    )
    ingress = serve.deployment(
        Ingress,
        name="ingress",
        max_ongoing_requests=max_ongoing * (args.replicas or 1),
        ray_actor_options={"num_cpus": INGRESS_CPUS},
    )
    return ingress.bind(replica.bind(args), args)


def app_builder(args: Mapping[str, Any]) -> Application:
    """``build_app`` for a Serve config: ``args`` maps ``paged serve`` flag names to values.

    ``{"api_key": ["a", "b"], "replicas": 2, "enable_prefix_caching": False}`` reads as
    ``--api-key a --api-key b --replicas 2 --no-enable-prefix-caching``.
    """
    return build_app(parse_flags(args))


def parse_flags(args: Mapping[str, Any]) -> argparse.Namespace:
    """The ``paged serve`` namespace for a mapping of flag names (``_`` or ``-``) to values."""
    from integrations.openai_server.command import add_arguments

    argv: list[str] = []
    for name, value in args.items():
        name = str(name).replace("_", "-")
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if isinstance(item, bool):
                argv.append(f"--{name}" if item else f"--no-{name}")
            elif item is not None:
                argv += [f"--{name}", str(item)]
    parser = argparse.ArgumentParser(prog="paged serve", exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(argv)
