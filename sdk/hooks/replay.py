"""The replay part of an audit record: what re-running a request token for token takes.

``AuditLog(path, replay="inline" | "digest")`` adds to each record of a request that
reached an in-process engine: the model (as the engine was given it, and its
``model_digest``), the engine's version and numeric settings, every sampling parameter in
effect (defaults resolved, the structured-output constraint included), and the prompt
and completion token ids. ``"digest"`` writes the ids to a ``TokenStore`` and only their
sha256 to the record. ``paged replay`` (``integrations.replay``) reads them back.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from sdk.hooks.base import ModelSource, RequestContext
from sdk.transport import InProcessTransport, Transport, engine_constraint

ReplayMode = Literal["inline", "digest"]
REPLAY_MODES: tuple[str, ...] = ("inline", "digest")
REPLAYABLE_FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})
ENGINE_PACKAGE = "paged"

_DIGEST_SCHEME = b"paged-model-digest/1\n"
_MODEL_SUFFIXES = (".json", ".safetensors", ".jinja", ".model", ".txt")
_WHOLE_FILE_BYTES = 4 << 20  # files up to this size are hashed whole
_HEAD_BYTES = 1 << 20  # a weight file's header (tensor names, shapes, dtypes) and first tensors
_NUM_WINDOWS = 256
_WINDOW_BYTES = 4 << 10


@functools.cache
def engine_version() -> str:
    """The installed ``paged`` package's version, or ``"unknown"`` when run from a bare source tree."""
    try:
        return importlib.metadata.version(ENGINE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=16)
def model_digest(model_dir: Path) -> str:
    """A sha256 that tells one model from another: its config, tokenizer and a sample of its weights.

    Every config and tokenizer file is hashed whole; each weight file by its size, its first
    MiB (the safetensors header: every tensor's name, shape and offset) and 256 windows of
    4 KiB spread evenly over the rest. Two different checkpoints of one architecture (a
    fine-tune, another seed) differ throughout their weights, so they differ here; reading
    ~2 MiB per file keeps it a few milliseconds at any model size. It identifies a model; it
    does not prove a file unaltered (a change between windows goes unseen). The conversion
    cache's manifest (which names the source path) is left out, so a GGUF's digest is the same
    wherever the file lies. Cached per directory: computed once per engine.
    """
    digest = hashlib.sha256(_DIGEST_SCHEME)
    for file in sorted(Path(model_dir).iterdir()):
        if not file.is_file() or file.suffix not in _MODEL_SUFFIXES or file.name.startswith("paged-"):
            continue
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\n".encode())
        with file.open("rb") as f:
            if size <= _WHOLE_FILE_BYTES:
                digest.update(f.read())
                continue
            digest.update(f.read(_HEAD_BYTES))
            span = size - _HEAD_BYTES - _WINDOW_BYTES
            for i in range(_NUM_WINDOWS):
                f.seek(_HEAD_BYTES + span * i // (_NUM_WINDOWS - 1))
                digest.update(f.read(_WINDOW_BYTES))
    return digest.hexdigest()


def model_source(transport: Transport) -> ModelSource | None:
    """The model and numeric settings of ``transport``'s in-process engine (after ``start()``).

    None over a remote transport, or an in-process one driving something other than an
    ``engine.AsyncEngine`` (a test double): nothing then says which weights served.
    """
    if not isinstance(transport, InProcessTransport):
        return None
    from engine.async_engine import AsyncEngine  # NOTE: here: a remote client never loads the engine's core

    if not isinstance(transport.engine, AsyncEngine):
        return None
    # NOTE: the AsyncEngine's own record, not its live Engine: a client's first request may come while a fresh one starts
    engine = transport.engine
    config = engine.config
    settings = {
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": engine.device.type,
        "quantization": config.quantization,
        "attention_backend": config.attention_backend,
        "max_model_len": engine.max_model_len,
    }
    model = None if config.model is None else str(config.model)
    return ModelSource(model=model, model_dir=Path(engine.model_dir), settings=settings)


def token_digest(token_ids: Sequence[int]) -> str:
    """The sha256 of a token-id list's canonical JSON (``[1,2,3]``): its name in a ``TokenStore``."""
    return hashlib.sha256(_canonical(token_ids)).hexdigest()


def _canonical(token_ids: Sequence[int]) -> bytes:
    return json.dumps(list(token_ids), separators=(",", ":")).encode()


class TokenStoreError(ValueError):
    """A ``TokenStore`` lacks a digest, or holds content that does not match it."""


class TokenStore:
    """Content-addressed token-id lists: ``ROOT/ab/abcd....json``, each named by its ``token_digest``.

    Writes go through a temporary file and a rename, so a reader never sees a partial list;
    a list already stored is not written again.

    Args:
        root: the store's folder; created on the first write.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, digest: str) -> Path:
        return self.root / digest[:2] / f"{digest}.json"

    def put(self, token_ids: Sequence[int]) -> str:
        """Store ``token_ids``; returns their digest."""
        data = _canonical(token_ids)
        digest = hashlib.sha256(data).hexdigest()
        path = self._path(digest)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            staging.write_bytes(data)
            os.replace(staging, path)
        return digest

    def get(self, digest: str) -> list[int]:
        """The token ids stored under ``digest``.

        Raises:
            TokenStoreError: none are stored, or the file's content does not hash to ``digest``.
        """
        path = self._path(digest)
        try:
            data = path.read_bytes()
        except OSError:
            raise TokenStoreError(f"token store {str(self.root)!r} has no entry {digest}") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise TokenStoreError(f"token store entry {str(path)!r} does not match its digest {digest}")
        return json.loads(data)


def replay_part(ctx: RequestContext, mode: ReplayMode, store: TokenStore | None, store_name: str | None) -> dict[str, Any] | None:
    """The ``replay`` field of a request's audit record; None for a request that never reached the engine.

    Args:
        ctx: the finished request.
        mode: ``"inline"`` writes the token ids into the record, ``"digest"`` into ``store``.
        store: where ``"digest"`` writes them.
        store_name: the store's folder as the record names it (relative to the log's folder).
    """
    request = ctx.engine_request
    if request is None or ctx.prompt_token_ids is None:
        return None
    params = SamplingParams(**request.sampling.sampling_kwargs())
    constraint = engine_constraint(request)
    source = ctx.model_source
    part: dict[str, Any] = {
        "model_path": None if source is None else source.model,
        "model_digest": None if source is None else model_digest(source.model_dir),
        "engine_version": engine_version(),
        "engine": None if source is None else dict(source.settings),
        "params": {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "structured_output"},
        "structured_output": None if constraint is None else _constraint_fields(constraint),
    }
    if mode == "inline":
        part["prompt_token_ids"] = list(ctx.prompt_token_ids)
        part["completion_token_ids"] = [list(ids) for ids in ctx.output_token_ids]
    else:
        assert store is not None
        part["store"] = store_name
        part["prompt_digest"] = store.put(ctx.prompt_token_ids)
        part["completion_digests"] = [store.put(ids) for ids in ctx.output_token_ids]
    return part


def _constraint_fields(constraint: StructuredOutput) -> dict[str, Any]:
    """The one form a constraint takes, as ``{form: value}`` (``StructuredOutput(**it)`` rebuilds it)."""
    return {constraint.form: getattr(constraint, constraint.form)}


@dataclass(frozen=True, slots=True)
class ReplayInputs:
    """A record's replay part read back: what to run and what it gave."""

    request_id: str
    model: str  # the served model's name
    model_path: str | None
    model_digest: str | None
    engine_version: str
    engine_settings: dict[str, Any] | None
    params: SamplingParams
    prompt_token_ids: list[int]
    completion_token_ids: list[list[int]]


def read_replay_part(record: dict[str, Any], store: TokenStore | None) -> ReplayInputs:
    """The replay inputs of an audit record holding a replay part.

    Args:
        record: one audit record whose ``replay`` is set.
        store: the token store of a ``"digest"`` record.

    Raises:
        TokenStoreError: a digest record without a store, or whose store lacks its ids.
        KeyError, TypeError, ValueError: the part is malformed (engine errors name the parameter).
    """
    part = record["replay"]
    constraint = part.get("structured_output")
    params = SamplingParams(**part["params"], structured_output=StructuredOutput(**constraint) if constraint else None)
    if "prompt_token_ids" in part:
        prompt, completions = part["prompt_token_ids"], part["completion_token_ids"]
    else:
        if store is None:
            raise TokenStoreError("the record holds token digests but no token store was named")
        prompt = store.get(part["prompt_digest"])
        completions = [store.get(d) for d in part["completion_digests"]]
    return ReplayInputs(
        request_id=record["request_id"],
        model=record["model"],
        model_path=part["model_path"],
        model_digest=part["model_digest"],
        engine_version=part["engine_version"],
        engine_settings=part["engine"],
        params=params,
        prompt_token_ids=list(prompt),
        completion_token_ids=[list(ids) for ids in completions],
    )
