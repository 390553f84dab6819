"""ResponseStore: stored responses, keyed by tenant and id, bounded by bytes and age; on disk when given a directory.

A stored response keeps the response as it was answered and its conversation: every item it
continued, then its input (``GET /v1/responses/{id}/input_items`` lists them), so a later request
can continue it from its id alone. Entries are keyed by ``(tenant, response id)``: another tenant's
id is not in a tenant's store (a 404, as an unknown one). Past ``store_max_bytes`` (the entries'
JSON) the oldest are dropped; past ``store_max_age_s`` an entry is gone.

With a ``directory`` (``paged serve`` uses ``<kv_cache_dir>/responses``), each entry is also a
JSON file named by a hash of its key, written (to a temporary name, then renamed) and removed
in order on one thread of its own, and the store is read back at start-up: a restart keeps the
responses that are still within their bounds. Unreadable files are skipped and removed.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdk.responses.config import ResponsesConfig
from sdk.responses.types import Response

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_SUFFIX = ".json"


@dataclass
class StoredResponse:
    """A response and its conversation, as the store keeps them."""

    tenant: str
    response: Response
    items: list[dict[str, Any]]
    """The conversation as input items: what the response continued, then its own input."""
    cache_salt: str | None = None
    """The request's own cache salt; a continuation runs under it too."""
    created: float = field(default_factory=time.time)
    size: int = 0
    """Bytes of its JSON (set by the store)."""

    @property
    def key(self) -> tuple[str, str]:
        return self.tenant, self.response.id

    def conversation(self) -> list[dict[str, Any]]:
        """The items a continuation starts from: the conversation, then the response's output."""
        return [*self.items, *(item.model_dump(mode="json") for item in self.response.output)]

    def to_json(self) -> str:
        return json.dumps({
            "version": FORMAT_VERSION, "tenant": self.tenant, "created": self.created, "cache_salt": self.cache_salt,
            "response": self.response.model_dump(mode="json"), "items": self.items,
        })  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> StoredResponse:
        """Raises ValueError (or a pydantic ValidationError, one) for anything but a record of this format."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ValueError("not a stored response of this format")
        return cls(
            tenant=str(data["tenant"]), response=Response.model_validate(data["response"]), items=list(data["items"]),
            cache_salt=data.get("cache_salt"), created=float(data["created"]), size=len(text.encode()),
        )  # fmt: skip


class ResponseStore:
    """Stored responses of every tenant, within ``config``'s bounds.

    Args:
        config: the bounds (``store_max_bytes``, ``store_max_age_s``); None = ``ResponsesConfig()``.
        directory: keep the entries there too, and load them from there now; None = in memory only.
        clock: the wall clock (seconds), for ages that outlive the process.
    """

    def __init__(
        self, config: ResponsesConfig | None = None, directory: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.config = config or ResponsesConfig()
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()  # oldest first
        self.num_bytes = 0
        self.dropped: Counter[str] = Counter()
        """Entries removed, by reason: ``size`` (past the byte bound), ``age``, ``deleted``."""
        self._directory = Path(directory) if directory is not None else None
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        if self._directory is not None:
            self._directory.mkdir(parents=True, exist_ok=True)
            self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-responses")
            self._load()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, stored: StoredResponse) -> list[StoredResponse]:
        """Keep ``stored``; returns the entries dropped to stay within the bounds (maybe ``stored`` itself)."""
        text = stored.to_json()
        stored.size = len(text.encode())
        if (replaced := self._entries.pop(stored.key, None)) is not None:
            self.num_bytes -= replaced.size
        self._entries[stored.key] = stored
        self.num_bytes += stored.size
        self._write(stored.key, text)
        return self.expire() + self._shrink()

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's stored response of that id; None when it has none (never another tenant's)."""
        stored = self._entries.get((tenant, response_id))
        if stored is not None and self._expired(stored):
            self.expire()
            return None
        return stored

    def delete(self, tenant: str, response_id: str) -> StoredResponse | None:
        """Drop the tenant's response of that id; the entry dropped, or None when it had none."""
        stored = self.get(tenant, response_id)
        if stored is not None:
            self._drop(stored, "deleted")
        return stored

    def expire(self) -> list[StoredResponse]:
        """Drop the entries past their age; returns them."""
        expired = [stored for stored in self._entries.values() if self._expired(stored)]
        for stored in expired:
            self._drop(stored, "age")
        return expired

    def close(self) -> None:
        """Wait for the files being written; the store stays readable."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    # ------------------------------------------------------------------ bounds

    def _expired(self, stored: StoredResponse) -> bool:
        return self._clock() - stored.created > self.config.store_max_age_s

    def _shrink(self) -> list[StoredResponse]:
        dropped = []
        while self.num_bytes > self.config.store_max_bytes and self._entries:
            oldest = next(iter(self._entries.values()))
            self._drop(oldest, "size")
            dropped.append(oldest)
        return dropped

    def _drop(self, stored: StoredResponse, reason: str) -> None:
        del self._entries[stored.key]
        self.num_bytes -= stored.size
        self.dropped[reason] += 1
        self._remove(stored.key)

    # ------------------------------------------------------------------ disk

    def _path(self, key: tuple[str, str]) -> Path:
        assert self._directory is not None
        return self._directory / (hashlib.sha256(json.dumps(key).encode()).hexdigest() + _SUFFIX)

    def _write(self, key: tuple[str, str], text: str) -> None:
        if self._writer is not None:
            self._writer.submit(_write_file, self._path(key), text)

    def _remove(self, key: tuple[str, str]) -> None:
        if self._writer is not None:
            self._writer.submit(_remove_file, self._path(key))

    def _load(self) -> None:
        assert self._directory is not None
        loaded = []
        for path in self._directory.glob("*" + _SUFFIX):
            try:
                stored = StoredResponse.from_json(path.read_text())
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("responses: skipping %s: %s", path.name, exc)
                _remove_file(path)
                continue
            if path != self._path(stored.key):
                _remove_file(path)  # NOTE: a file claims only the key it is named by
                continue
            loaded.append(stored)
        for stored in sorted(loaded, key=lambda s: s.created):
            self._entries[stored.key] = stored
            self.num_bytes += stored.size
        dropped = self.expire() + self._shrink()
        logger.info("responses: %d stored responses loaded from %s (%d past their bounds)", len(self), self._directory, len(dropped))


def _write_file(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        logger.exception("responses: could not write %s", path)


def _remove_file(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        logger.exception("responses: could not remove %s", path)
