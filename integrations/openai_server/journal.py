"""RequestJournal: the requests a drain cut off, kept under ``<kv_cache_dir>/journal`` for the next server to finish.

With ``drain_journal`` on, a chat, completion or stored Responses API request still running when
SIGTERM's drain times out is written here instead of only ending with an error: its wire body (prompt and
sampling knobs, seed included), its route, id and tenant, and the output its caller already
received (token ids and text; the whole output so far for a request that was not streamed).
A server started on the same ``kv_cache_dir`` replays each entry as a continuation
(``journal_replay``) and removes it once its result is kept.

One JSON file per request, written to a temporary name and renamed, so a file is whole or
absent. A file that is not an entry of this format is reported and removed at start-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_SUFFIX = ".json"
_PLAIN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
ROUTES = ("chat", "completion", "response")


@dataclass
class JournalEntry:
    """One request cut off by a drain: what a continuation needs, and what its caller already got."""

    request_id: str
    route: str
    """``chat``, ``completion`` or ``response``: which wire body ``body`` is."""
    tenant: str
    model: str
    """The served model's name: an entry of another model is not replayed."""
    body: dict[str, Any]
    """The request's wire body (prompt, sampling knobs, seed) as the client sent it."""
    token_ids: list[int] = field(default_factory=list)
    """Output tokens its caller received (streamed), or the output so far (not streamed)."""
    text: str = ""
    reasoning: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def to_json(self) -> str:
        return json.dumps({"version": FORMAT_VERSION, **asdict(self)})

    @classmethod
    def from_json(cls, text: str) -> JournalEntry:
        """Raises ValueError for anything but an entry of this format (the message names the field)."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.pop("version", None) != FORMAT_VERSION:
            raise ValueError("version: not a journal entry of this format")
        entry = cls(**data)
        checks = {
            "request_id": isinstance(entry.request_id, str) and bool(entry.request_id),
            "route": entry.route in ROUTES,
            "tenant": isinstance(entry.tenant, str),
            "model": isinstance(entry.model, str),
            "body": isinstance(entry.body, dict),
            "token_ids": isinstance(entry.token_ids, list) and all(type(t) is int for t in entry.token_ids),
            "text": isinstance(entry.text, str),
            "reasoning": isinstance(entry.reasoning, str),
            "created": type(entry.created) is int,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: not a valid value")
        return entry


class RequestJournal:
    """The journal directory: entries written by a draining server, read by the next one.

    Args:
        directory: where the entries live (``<kv_cache_dir>/journal``); created if missing.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def write(self, entry: JournalEntry) -> None:
        """Keeps ``entry`` (replacing one of the same id).

        Raises:
            OSError: the directory cannot be written.
        """
        path = self._path(entry.request_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(entry.to_json())
        os.replace(tmp, path)

    def load(self) -> list[JournalEntry]:
        """Every readable entry, oldest first; each unreadable file is logged once and removed."""
        entries = []
        for path in sorted(self.directory.glob("*" + _SUFFIX)):
            try:
                entry = JournalEntry.from_json(path.read_text())
                if path != self._path(entry.request_id):
                    raise ValueError("request_id: not the id the file is named by")
            except (OSError, ValueError, TypeError) as exc:
                logger.warning("journal: skipping %s: %s", path.name, exc)
                _remove(path)
                continue
            entries.append(entry)
        return sorted(entries, key=lambda e: e.created)

    def remove(self, request_id: str) -> None:
        """Drops the entry of ``request_id`` (its result is kept, or it cannot be replayed); a missing one is a no-op."""
        _remove(self._path(request_id))

    def _path(self, request_id: str) -> Path:
        name = request_id if _PLAIN_ID.fullmatch(request_id) else hashlib.sha256(request_id.encode()).hexdigest()
        return self.directory / (name + _SUFFIX)


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        logger.exception("journal: could not remove %s", path)
