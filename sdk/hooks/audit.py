"""AuditLog: one hash-chained JSON line per request, appended and flushed as each request ends."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from sdk.hooks.base import Hook, RequestContext
from sdk.hooks.replay import REPLAY_MODES, ReplayMode, TokenStore, replay_part
from sdk.types import ChatMessage

logger = logging.getLogger(__name__)

GENESIS_HASH = "0" * 64
RECORD_VERSION = 1


class AuditChainBroken(ValueError):
    """``AuditLog.verify`` found a record that was edited, removed, reordered or is not JSON."""

    def __init__(self, path: Path, line: int, reason: str) -> None:
        super().__init__(f"{path}: audit chain broken at line {line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


def _digest(record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "hash"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="milliseconds")


def _without_image_bytes(message: ChatMessage) -> dict[str, Any]:
    """A message as the record writes it: an image part's URL only when it is a remote one, never a data URL's bytes."""
    body = message.model_dump(exclude_none=True)
    for j, part in message.image_parts:
        if part.image_url.url.startswith("data:"):
            body["content"][j]["image_url"]["url"] = "data:(omitted)"
    return body


class AuditLog(Hook):
    """Writes one JSON line per request end, each carrying the hash of the one before.

    A record holds who, when, what model, token counts, finish reason, filter decisions
    and latency, and for a request with images each one's sha256, bytes, width, height and
    MIME type (``images``); never prompt or completion text unless ``include_text=True``,
    and never an image's bytes (with ``include_text``, a data URL is written as ``data:(omitted)``). Each line
    is appended and flushed on its own, so a crash loses at most the record in flight; an
    unterminated last line (a crash mid-write) is cut off when the log is reopened.
    Failures to write are logged and counted by the client, never silent, and never fail
    the request (``fail_closed = False``).

    With ``replay`` set, each record of a request that reached an in-process engine also
    holds what ``paged replay`` needs to re-run it (``sdk.hooks.replay``): the token ids
    themselves (``"inline"``), or their sha256 with the ids in a content-addressed
    ``TokenStore`` beside the log (``"digest"``). Token ids are the prompt and completion
    in another form, so this is an opt-in like ``include_text``.

    Args:
        path: the JSON-lines file; created with its parent folder when missing.
        include_text: also write the (post-redaction) prompt and the completion text.
        fsync: ``os.fsync`` after each record (survives power loss, costs a disk sync).
        replay: ``"inline"`` or ``"digest"`` adds the ``replay`` part; None (the default) leaves it out.
        store: the token store's folder for ``replay="digest"``; default ``PATH.tokens`` beside the log.

    Raises:
        ValueError: an unknown ``replay`` mode, or a ``store`` without ``replay="digest"``.
    """

    fail_closed = False

    def __init__(
        self, path: str | os.PathLike[str], *, include_text: bool = False, fsync: bool = False,
        replay: ReplayMode | None = None, store: str | os.PathLike[str] | None = None,
    ) -> None:  # fmt: skip
        if replay is not None and replay not in REPLAY_MODES:
            raise ValueError(f"replay must be one of {', '.join(REPLAY_MODES)} or None; got {replay!r}")
        if store is not None and replay != "digest":
            raise ValueError("store is where replay='digest' writes token ids; it needs replay='digest'")
        self.path = Path(path)
        self.include_text = include_text
        self.fsync = fsync
        self.replay = replay
        self.store = TokenStore(store if store is not None else f"{self.path}.tokens") if replay == "digest" else None
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._last_hash = self._recover()
        self._file = self.path.open("a", encoding="utf-8")

    def _recover(self) -> str:
        if not self.path.exists():
            return GENESIS_HASH
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            logger.warning("audit log %s: dropping an unterminated last record (%d bytes)", self.path, len(data) - end)
            with self.path.open("r+b") as f:
                f.truncate(end)
        last = data[:end].rstrip(b"\n").rsplit(b"\n", 1)[-1]
        return json.loads(last)["hash"] if last else GENESIS_HASH

    def build_record(self, ctx: RequestContext) -> dict[str, Any]:
        """The record of one finished request, without its chain fields."""
        record: dict[str, Any] = {
            "v": RECORD_VERSION,
            "request_id": ctx.request_id,
            "tenant": ctx.tenant,
            "model": ctx.model,
            "route": ctx.route,
            "kind": ctx.kind,
            "started_at": _iso(ctx.started_at),
            "latency_s": None if ctx.latency is None else round(ctx.latency, 6),
            "ttft_s": None if ctx.ttft is None else round(ctx.ttft, 6),
            "prompt_tokens": ctx.usage.prompt_tokens,
            "completion_tokens": ctx.usage.completion_tokens,
            "cached_tokens": ctx.usage.cached_tokens,
            # the engine's split of the request's time (queue, prefill, decode, preempted) and
            # of its prompt (computed, cached); None when it did not finish in the engine
            "latency_breakdown": None if ctx.usage.latency is None else dataclasses.asdict(ctx.usage.latency),
            "finish_reason": ctx.finish_reason,
            "error": None if ctx.error is None else type(ctx.error).__name__,
            "decisions": [
                {"hook": d.hook, "stage": d.stage, "action": d.action, "detail": d.detail} for d in ctx.decisions
            ],
            "completion_chars": sum(map(len, ctx.output_texts)),
            "reasoning_chars": sum(map(len, ctx.reasoning_texts)),
            "tool_calls": [c.name for calls in ctx.tool_calls for c in calls],
        }
        if ctx.is_pooling:  # NOTE: embed / rerank / score: how many inputs (documents); prompt_tokens is what it read
            record["num_inputs"] = len(ctx.inputs or ())
        if ctx.images:  # NOTE: each image's hash and size, never its bytes
            record["images"] = [image.to_dict() for image in ctx.images]
        if self.include_text:
            record["messages"] = None if ctx.messages is None else [_without_image_bytes(m) for m in ctx.messages]
            record["prompt"] = ctx.prompt
            # one completion (the usual case) as a str, n > 1 of them as a list
            record["completion"] = ctx.output_text if len(ctx.output_texts) == 1 else list(ctx.output_texts)
            record["reasoning"] = ctx.reasoning_texts[0] if len(ctx.reasoning_texts) == 1 else ctx.reasoning_texts
            record["tool_call_arguments"] = [
                {"id": c.id, "name": c.name, "arguments": c.arguments} for calls in ctx.tool_calls for c in calls
            ]
            if ctx.is_pooling:
                record["inputs"], record["query"] = ctx.inputs, ctx.query
        if self.replay is not None:
            record["replay"] = replay_part(ctx, self.replay, self.store, self._store_name())
        return record

    def _store_name(self) -> str | None:
        """The token store's folder as records name it: relative to the log's folder when inside it."""
        if self.store is None:
            return None
        root = self.store.root.absolute()
        try:
            return str(root.relative_to(self.path.parent.absolute()))
        except ValueError:
            return str(root)

    async def on_finish(self, ctx: RequestContext) -> None:
        record = self.build_record(ctx)
        with self._lock:
            record["prev_hash"] = self._last_hash
            record["hash"] = _digest(record)
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
            self._last_hash = record["hash"]

    def close(self) -> None:
        """Close the file; later records raise (and are counted as hook failures)."""
        with self._lock:
            self._file.close()

    @staticmethod
    def verify(path: str | os.PathLike[str]) -> int:
        """Check the hash chain of an audit log.

        Args:
            path: the log file.

        Returns:
            The number of records, all intact.

        Raises:
            AuditChainBroken: naming the first line that is not JSON, whose hash does not
                match its content, or whose ``prev_hash`` is not the previous record's hash
                (a record was edited, removed, inserted or reordered).
        """
        path = Path(path)
        prev = GENESIS_HASH
        count = 0
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise AuditChainBroken(path, line_no, "not a JSON record") from None
                if not isinstance(record, dict) or "hash" not in record:
                    raise AuditChainBroken(path, line_no, "record has no hash")
                if record.get("prev_hash") != prev:
                    raise AuditChainBroken(path, line_no, "prev_hash does not match the previous record")
                if _digest(record) != record["hash"]:
                    raise AuditChainBroken(path, line_no, "hash does not match the record's content")
                prev = record["hash"]
                count += 1
        return count
