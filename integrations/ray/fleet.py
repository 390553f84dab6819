"""``paged serve --replicas N``: the fleet on a local Ray cluster, or on an existing one by address."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import threading
from collections.abc import Callable

from aiohttp import web

logger = logging.getLogger(__name__)


def serve_fleet(args: argparse.Namespace, make_app: Callable[[argparse.Namespace], web.Application]) -> int:
    """Deploy the fleet for ``args`` (each replica serving ``make_app(args)``), serve until SIGTERM/SIGINT, delete it.

    Without ``--ray-address`` a local Ray cluster starts (and stops) with the command; with one
    the fleet deploys onto that cluster and leaves it running when it is deleted.
    """
    try:
        make_app(argparse.Namespace(**{**vars(args), "audit_log": None}))  # the flags, checked before Ray starts
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    import ray
    from ray import serve

    from integrations.ray.app import APP_NAME, INGRESS_CPUS, build_app

    num_cpus = None
    if args.ray_address is None:
        # NOTE: logical CPUs are reservations: a local cluster gets enough for every replica and
        # the ingress even on a machine with fewer cores, rather than a fleet that never schedules.
        ranks = args.replicas * args.tensor_parallel_size * args.pipeline_parallel_size
        num_cpus = max(os.cpu_count() or 1, math.ceil(ranks * args.replica_cpus + INGRESS_CPUS))
    ray.init(address=args.ray_address, num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(args, make_app), name=APP_NAME, route_prefix="/")
        logger.info("serving %d replicas on http://%s:%d (routing: %s)", args.replicas, args.host, args.port, args.routing)
        stop.wait()
        logger.info("stopping the fleet")
        serve.delete(APP_NAME)
    finally:
        if args.ray_address is None:
            serve.shutdown()
        ray.shutdown()
    return 0
