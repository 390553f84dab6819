"""The fleet for Ray Serve config files: ``import_path: integrations.ray.config:app_builder``.

``args`` in the config are the ``paged serve`` flags as a mapping::

    applications:
      - name: paged
        route_prefix: /
        import_path: integrations.ray.config:app_builder
        args: {replicas: 2, model: /models/qwen, api_key: [sk-1], max_num_seqs: 64}
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ray.serve import Application

from integrations.openai_server.command import add_arguments, make_app
from integrations.ray.app import build_app


def app_builder(args: Mapping[str, Any]) -> Application:
    """The fleet for a Serve config's ``args``: ``paged serve`` flag names mapped to values.

    ``{"api_key": ["a", "b"], "replicas": 2, "enable_prefix_caching": False}`` reads as
    ``--api-key a --api-key b --replicas 2 --no-enable-prefix-caching``.

    Raises:
        FlagError: an engine flag the config refuses.
    """
    return build_app(parse_flags(args), make_app)


def parse_flags(args: Mapping[str, Any]) -> argparse.Namespace:
    """The ``paged serve`` namespace for a mapping of flag names (``_`` or ``-``) to values."""
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
