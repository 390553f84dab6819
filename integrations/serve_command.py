"""``paged serve``: the OpenAI-compatible HTTP server from the command line, one engine in this process or
``--replicas`` of them on Ray Serve (``integrations.ray``, the ``ray`` extra)."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from integrations.engine_flags import FlagError, engine_config
from integrations.openai_server.command import add_arguments, make_app

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT: one engine in this process, or ``--replicas`` of them on Ray Serve.

    Raises:
        FlagError: an engine flag the config refuses (``paged`` reports it as a usage error),
            before anything binds or loads.
    """
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.replicas is not None:
        engine_config(args)
        if len(args.model or ()) > 1:
            logger.error("--replicas serves one model: each replica would load every --model")
            return 2
        from integrations.ray.fleet import serve_fleet  # needs the ``ray`` extra

        return serve_fleet(args, make_app)
    try:
        app = make_app(args)
    except FlagError:
        raise
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    # NOTE: SIGTERM/SIGINT start the graceful shutdown (app.on_shutdown drains); the runner's
    # own timeout only has to cover the drain plus the final answers.
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        shutdown_timeout=args.drain_timeout + 10.0,
        handler_cancellation=True,
        print=lambda msg: logger.info("%s", msg),
    )
    return 0
