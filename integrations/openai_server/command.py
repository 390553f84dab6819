"""``paged serve``: the OpenAI-compatible HTTP server from the command line."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path

from aiohttp import web

from integrations.engine_flags import add_engine_arguments, engine_config, engine_kwargs, parse_size
from integrations.openai_server.app import DEFAULT_CLIENT_MAX_SIZE, DEFAULT_DRAIN_TIMEOUT, create_app

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument(
        "--served-model-name", default=None,
        help="model id clients send and /v1/models lists (default: the model's name)",
    )
    server.add_argument(
        "--host", default="127.0.0.1",
        help="address to bind (default: %(default)s; anything else should have --api-key)",
    )
    server.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    server.add_argument(
        "--api-key", action="append", default=None, metavar="[NAME=]KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health; repeat for several "
        "keys; NAME is the tenant the hooks and audit log see (default: a short hash of KEY). "
        "Also read from PAGED_API_KEY.",
    )
    server.add_argument(
        "--max-body-size", type=parse_size, default=DEFAULT_CLIENT_MAX_SIZE,
        help="largest request body; larger gets 413 (default: 4MiB)",
    )
    server.add_argument(
        "--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT,
        help="seconds in-flight requests get to finish on SIGTERM before they are aborted "
        "(default: %(default)s)",
    )
    server.add_argument(
        "--audit-log", default=None, metavar="PATH",
        help="append one JSON line per request to PATH (sdk.hooks.AuditLog)",
    )
    server.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")

    add_engine_arguments(parser)


def api_keys(args: argparse.Namespace) -> dict[str, str] | None:
    """``{tenant: key}`` from ``--api-key`` / ``PAGED_API_KEY``; unnamed keys get a hash tenant."""
    from integrations.openai_server.state import key_id

    values = list(args.api_key or ())
    if not values and os.environ.get("PAGED_API_KEY"):
        values = [os.environ["PAGED_API_KEY"]]
    keys = {}
    for value in values:
        name, sep, key = value.partition("=")
        if not sep or not name or not key or key.startswith("="):  # a bare key (base64 may end in '=')
            name, key = key_id(value), value
        keys[name] = key
    return keys or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT.

    Raises:
        FlagError: an engine flag the config refuses (``paged`` reports it as a usage error),
            before anything binds or loads.
    """
    engine_config(args)  # checks every engine flag now; the engine itself loads after binding
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = engine_kwargs(args)
    model = config.pop("model")
    if model is not None and not Path(model).exists():
        logger.error("model path %s does not exist", model)
        return 2
    keys = api_keys(args)
    if keys is None and not is_loopback(args.host):
        logger.warning(
            "binding %s without --api-key: anyone who can reach this port can use the model",
            args.host,
        )
    hooks = []
    if args.audit_log:
        from sdk.hooks import AuditLog

        hooks.append(AuditLog(args.audit_log))
    app = create_app(
        model,
        api_key=keys,
        served_model_name=args.served_model_name,
        hooks=hooks,
        client_max_size=args.max_body_size,
        drain_timeout=args.drain_timeout,
        **config,
    )
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
