"""The encoder cache: a vision encoder's output per image hash, least recently used first out, bounded in bytes."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class EncoderCache:
    """Image embeddings (a tensor each, sized by whoever adds it) by ``image_hash``; holds at most ``max_bytes``
    (an entry larger than that is not kept).

    Counts ``num_encoded`` (images the model encoded, ``add``) and ``num_hits`` (``get`` that found one).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_encoded = 0
        self.num_hits = 0
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, image_hash: str) -> bool:
        return image_hash in self._entries

    def get(self, image_hash: str) -> Any | None:
        entry = self._entries.get(image_hash)
        if entry is None:
            return None
        self._entries.move_to_end(image_hash)
        self.num_hits += 1
        return entry[0]

    def add(self, image_hash: str, embeddings: Any, nbytes: int) -> None:
        """Keeps an image's freshly encoded embeddings (``nbytes`` of them), evicting the least recently used."""
        self.num_encoded += 1
        if image_hash in self._entries:
            self.num_bytes -= self._entries.pop(image_hash)[1]
        if nbytes > self.max_bytes:
            return
        while self._entries and self.num_bytes + nbytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.num_bytes -= evicted
        self._entries[image_hash] = (embeddings, nbytes)
        self.num_bytes += nbytes
