"""``paged serve``'s flags and the application they build (``make_app``); ``integrations.serve_command`` runs it."""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from integrations.engine_flags import (
    add_engine_arguments,
    add_responses_arguments,
    add_restart_arguments,
    engine_config,
    engine_kwargs,
    parse_size,
    responses_config,
    restart_policy,
)
from integrations.openai_server.app import DEFAULT_CLIENT_MAX_SIZE, DEFAULT_DRAIN_TIMEOUT, create_app
from sdk.images import (
    DEFAULT_FETCH_TIMEOUT,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    ImageLimits,
)
from sdk.reasoning import REASONING_PARSERS

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument(
        "--served-model-name", action="append", default=None, metavar="NAME",
        help="model id clients send and /v1/models lists (default: the model's name); with --model repeated, "
        "repeat it once per --model, in the same order",
    )
    server.add_argument(
        "--reasoning-parser", default="auto", choices=REASONING_PARSERS,
        help="split a thinking model's reasoning into reasoning_content: auto (from the chat template), "
        "none, or a model family (default: %(default)s)",
    )
    server.add_argument(
        "--host", default="127.0.0.1",
        help="address to bind (default: %(default)s; anything else should have --api-key)",
    )
    server.add_argument(
        "--pooling-model", action="append", default=None, metavar="PATH",
        help="a pooling model (embedder, reranker: an HF directory) served beside --model under its directory's "
        "name; repeat for several. Requests go to the model they name; /v1/embeddings, /v1/rerank and "
        "/v1/score without one go to the first of these",
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
        "--drain-journal", action="store_true",
        help="requests still running when the drain times out are written to <kv-cache-dir>/journal instead of "
        "only aborted (their clients get 503 request_journalled with the id); a server started on the same "
        "--kv-cache-dir finishes them and serves each result at GET /v1/chat/completions/{id} (needs --kv-cache-dir; "
        "not with --replicas)",
    )
    server.add_argument(
        "--policy", default=None, metavar="PATH",
        help="the tenants, their keys (plain or sha256:HEX) and terms: priority cap, weight, rate limits, "
        "max_tokens, models, routes, cache isolation (a TOML file; see docs/server.md)",
    )
    server.add_argument(
        "--hook", action="append", default=None, metavar="MODULE:FACTORY",
        help="add the SDK hook(s) FACTORY() returns (a Hook or a list of them), e.g. a filter; repeatable, "
        "run in the order given",
    )
    server.add_argument(
        "--audit-log", default=None, metavar="PATH",
        help="append one JSON line per request to PATH (sdk.hooks.AuditLog); runs after the --hook hooks",
    )
    server.add_argument(
        "--audit-replay", default=None, choices=("inline", "digest"),
        help="also record what `paged replay` needs to re-run each request: token ids in the record (inline) "
        "or in a token store beside it (digest); needs --audit-log",
    )
    server.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    add_image_arguments(parser)
    fleet = parser.add_argument_group("fleet (Ray Serve; needs the 'ray' extra, see docs/scale_out.md)")
    fleet.add_argument(
        "--replicas", type=_positive_int, default=None, metavar="N",
        help="serve N engine replicas behind one endpoint on Ray Serve, routed by prompt prefix",
    )
    fleet.add_argument(
        "--ray-address", default=None, metavar="ADDRESS",
        help="the Ray cluster to deploy to ('auto', or ray://HOST:PORT); default: start a local one",
    )
    fleet.add_argument(
        "--replica-cpus", type=float, default=1.0,
        help="logical CPUs Ray reserves for each replica (default: %(default)s)",
    )
    fleet.add_argument(
        "--replica-gpus", type=float, default=0.0,
        help="GPUs Ray reserves for each replica; 1 pins each replica to its own device (default: %(default)s)",
    )
    fleet.add_argument(
        "--routing", choices=("prefix", "round_robin"), default="prefix",
        help="how the fleet picks a replica: by prompt prefix and load, or in turn (default: %(default)s)",
    )

    # NOTE: --model repeated serves several chat models, each its own engine, routed by the request's model
    add_engine_arguments(parser, repeatable=("model",))
    add_restart_arguments(parser)
    add_responses_arguments(parser)


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """The image intake's limits (``sdk.images.ImageLimits``), under vLLM's names where vLLM has them."""
    images = parser.add_argument_group("images (multimodal models; see docs/multimodal.md)")
    images.add_argument(
        "--limit-mm-per-prompt", type=_image_count, default=DEFAULT_MAX_IMAGES, metavar="JSON",
        help=f'images per request, as vLLM spells it: \'{{"image": N}}\' (default: {DEFAULT_MAX_IMAGES})',
    )
    images.add_argument(
        "--max-image-bytes", type=parse_size, default=DEFAULT_MAX_IMAGE_BYTES,
        help="largest encoded image (after base64 decoding); larger gets 400 (default: 10MiB)",
    )
    images.add_argument(
        "--max-image-pixels", type=_positive_int, default=DEFAULT_MAX_IMAGE_PIXELS,
        help="most pixels (width x height, read from the header before decoding) of one image (default: %(default)s)",
    )
    images.add_argument(
        "--allowed-media-domains", nargs="+", default=None, metavar="HOST",
        help="hosts whose http(s) image URLs the server fetches; without it remote image URLs get 400 (default: none)",
    )
    images.add_argument(
        "--image-fetch-timeout", type=float, default=DEFAULT_FETCH_TIMEOUT,
        help="seconds to fetch one remote image (default: %(default)s)",
    )


def image_limits(args: argparse.Namespace) -> ImageLimits:
    """The ``ImageLimits`` of the image flags.

    Raises:
        ValueError: a limit ``ImageLimits`` refuses, naming it.
    """
    return ImageLimits(
        max_images=args.limit_mm_per_prompt, max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
        allowed_media_domains=tuple(args.allowed_media_domains or ()), fetch_timeout=args.image_fetch_timeout,
    )  # fmt: skip


def _image_count(value: str) -> int:
    """``--limit-mm-per-prompt``: vLLM's ``{"image": N}``; other modalities are refused (images are the only one)."""
    try:
        limits = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f'expected JSON such as {{"image": 4}}, got {value!r}') from None
    if not isinstance(limits, dict) or set(limits) - {"image"} or not isinstance(limits.get("image", 0), int):
        raise argparse.ArgumentTypeError(f'only {{"image": N}} is supported (images are the one modality), got {value}')
    if limits.get("image", 0) < 0:
        raise argparse.ArgumentTypeError(f"the image limit must be >= 0, got {limits['image']}")
    return limits.get("image", DEFAULT_MAX_IMAGES)


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def api_keys(args: argparse.Namespace) -> dict[str, str] | None:
    """``{tenant: key}`` from ``--api-key`` / ``PAGED_API_KEY``; unnamed keys get a hash tenant."""
    from integrations.openai_server.policy import key_id

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


def load_hooks(specs: Iterable[str]) -> list[Any]:
    """The hooks of ``--hook module:factory`` specs: ``factory()`` of each, a Hook or an iterable of them.

    Raises:
        ValueError: a spec that is not ``module:factory``, does not import, or whose factory
            returns something other than SDK hooks; the message names the spec.
    """
    from sdk.hooks import Hook

    hooks: list[Any] = []
    for spec in specs:
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"--hook {spec}: expected MODULE:FACTORY")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--hook {spec}: {exc}") from None
        made = factory()
        made = [made] if isinstance(made, Hook) else list(made) if isinstance(made, Iterable) else [made]
        if not all(isinstance(h, Hook) for h in made):
            raise ValueError(f"--hook {spec}: {attr}() must return an sdk.hooks.Hook or a list of them")
        hooks.extend(made)
    return hooks


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_app(args: argparse.Namespace) -> web.Application:
    """The application ``paged serve`` runs for ``args``: the engine loads when the app starts.

    Raises:
        FlagError: an engine flag the config refuses.
        ValueError: a model path that does not exist, a policy file or ``--hook`` spec that does
            not load, ``--audit-replay`` without ``--audit-log``, ``--drain-journal`` without ``--kv-cache-dir``
            or with ``--replicas``, ``--served-model-name`` not given once per ``--model``, several ``--model`` with
            ``--replicas``, two models under one name; the message names it.
    """
    engine_config(args)  # checks every engine flag now; the engine itself loads after binding
    restart = restart_policy(args)
    responses = responses_config(args)
    config = engine_kwargs(args)
    config.pop("model")
    models = args.model or [None]
    for model in models:
        if model is not None and not Path(model).exists():
            raise ValueError(f"model path {model} does not exist")
    names = args.served_model_name
    if names is not None and len(names) != len(models):
        raise ValueError(
            f"--served-model-name given {len(names)} times for {len(models)} --model: name each model, in order"
        )
    if len(models) > 1 and getattr(args, "replicas", None):
        raise ValueError("--replicas serves one model: each replica would load every --model")
    for path in args.pooling_model or ():
        if not Path(path).is_dir():
            raise ValueError(f"--pooling-model {path} is not a model directory")
    keys = api_keys(args)
    from integrations.openai_server.policy import ServerPolicy

    policy = ServerPolicy.load(args.policy) if args.policy else None
    hooks = load_hooks(args.hook or ())
    if keys is None and not (policy and policy.key_table()) and not is_loopback(args.host):
        logger.warning(
            "binding %s without --api-key: anyone who can reach this port can use the model",
            args.host,
        )
    if args.drain_journal and config.get("kv_cache_dir") is None:
        raise ValueError("--drain-journal needs --kv-cache-dir: the journal is kept there")
    if args.drain_journal and getattr(args, "replicas", None):
        raise ValueError("--drain-journal serves one process: each of --replicas would replay the whole journal")
    if args.audit_replay and not args.audit_log:
        raise ValueError("--audit-replay needs --audit-log: the replay part is written into the audit records")
    if args.audit_log:
        from sdk.hooks import AuditLog

        hooks.append(AuditLog(args.audit_log, replay=args.audit_replay))
    return create_app(
        models[0] if len(models) == 1 else models,
        api_key=keys,
        policy=policy,
        served_model_name=names[0] if names is not None and len(names) == 1 else names,
        reasoning_parser=args.reasoning_parser,
        hooks=hooks,
        client_max_size=args.max_body_size,
        drain_timeout=args.drain_timeout,
        drain_journal=args.drain_journal,
        restart=restart,
        image_limits=image_limits(args),
        responses=responses,
        pooling_models=args.pooling_model or (),
        **config,
    )
