"""An image's content hash: what the prefix cache, the encoder cache and audit records know an image by."""

from __future__ import annotations

from hashlib import blake2b
from typing import Any


def image_hash(image: Any) -> str:
    """The 32-hex-digit BLAKE2b (128-bit) digest of a PIL image's mode, size and pixel bytes (and its palette, for
    palette modes): equal for images of equal pixels, whatever file or encoding they came from."""
    digest = blake2b(digest_size=16, person=b"paged.image")
    width, height = image.size
    digest.update(f"{image.mode}:{width}x{height}:".encode())
    if image.mode in ("P", "PA"):
        digest.update(bytes(image.getpalette() or ()))
    digest.update(image.tobytes())
    return digest.hexdigest()
