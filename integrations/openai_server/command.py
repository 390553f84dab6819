"""``paged serve``: the OpenAI-compatible HTTP server from the command line."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
from pathlib import Path

from aiohttp import web

from integrations.openai_server.app import DEFAULT_CLIENT_MAX_SIZE, DEFAULT_DRAIN_TIMEOUT, create_app

logger = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"512M"`` or plain bytes -> bytes (K/M/G/T are binary multiples)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512MiB, 2G)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument(
        "--model", default=None,
        help="HF directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )
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

    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and KV cache dtype (default: %(default)s)",
    )
    engine.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"),
        help="(default: %(default)s = cuda when available)",
    )
    engine.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV cache block (default: %(default)s)"
    )
    kv = engine.add_mutually_exclusive_group()
    kv.add_argument(
        "--kv-cache-memory", type=parse_size, default=None,
        help="KV cache size, e.g. 2GiB (default: 1GiB on CPU, most free memory on GPU)",
    )
    kv.add_argument(
        "--num-blocks", type=int, default=None,
        help="KV cache size in blocks (instead of --kv-cache-memory)",
    )
    engine.add_argument(
        "--max-num-seqs", type=int, default=128, help="most requests in one batch (default: %(default)s)"
    )
    engine.add_argument(
        "--max-num-batched-tokens", type=int, default=2048,
        help="token budget of one step (default: %(default)s)",
    )
    engine.add_argument(
        "--max-model-len", type=int, default=None,
        help="longest prompt + completion (default: the model's)",
    )
    engine.add_argument("--no-prefix-caching", action="store_true", help="turn prefix-block sharing off")
    engine.add_argument(
        "--attention-backend", default="auto", choices=("auto", "torch", "cpu", "triton"),
        help="(default: %(default)s = triton on CUDA, torch on CPU)",
    )

    admission = parser.add_argument_group("admission limits (beyond them requests get 429)")
    admission.add_argument(
        "--max-queued-requests", type=int, default=4096, help="waiting requests (default: %(default)s)"
    )
    admission.add_argument(
        "--max-queued-tokens", type=int, default=4_000_000,
        help="prompt tokens of waiting requests (default: %(default)s)",
    )


def engine_config(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields the flags set."""
    config = dict(
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=args.attention_backend,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
    )
    for name in ("kv_cache_memory", "num_blocks", "max_model_len"):
        if getattr(args, name) is not None:
            config[name] = getattr(args, name)
    return config


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
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from engine.config import EngineConfig

    config = engine_config(args)
    try:
        EngineConfig(model=args.model, **config)  # fail fast on bad flags, before binding
    except ValueError as exc:
        logger.error("invalid engine settings: %s", exc)
        return 2
    if args.model is not None and not Path(args.model).exists():
        logger.error("model path %s does not exist", args.model)
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
        args.model,
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
