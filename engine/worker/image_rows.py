"""A step's image rows: which rows of the flat batch are image tokens, and the encoder output that fills them.

A prefill chunk may hold part of an image's run (a chunk boundary, or a prefix-cache hit, cuts it): its rows take
the matching slice of the image's embeddings. Embeddings come from the encoder cache, else every image missing
from it is encoded in one batch and cached.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.core.scheduler_output import ScheduledRequest
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import ImageInput

# the encoder cache's bound: LLaVA-1.5's 576 rows of 4096 float32 values take 9 MiB an image
ENCODER_CACHE_BYTES = 256 << 20


def image_rows(
    scheduled: list[ScheduledRequest], model: torch.nn.Module, cache: EncoderCache, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(embeddings [R, hidden], rows [R])`` of the step's image tokens, in row order; None when it has none.

    Row ``rows[j]`` of the batch (requests' tokens back to back, in ``scheduled``'s order) takes ``embeddings[j]``.
    """
    pieces: list[tuple[ImageInput, int, int, int]] = []  # image, first and end index into its rows, batch row
    row = 0
    for request in scheduled:
        start, stop = request.num_computed_tokens, request.num_computed_tokens + len(request.token_ids)
        for image in request.images:
            first, end = max(image.offset, start), min(image.offset + image.length, stop)
            if first < end:
                pieces.append((image, first - image.offset, end - image.offset, row + first - start))
        row += len(request.token_ids)
    if not pieces:
        return None
    embeddings = _embeddings([image for image, *_ in pieces], model, cache, device)
    rows = np.concatenate([np.arange(at, at + end - first) for _, first, end, at in pieces])
    chunks = [embeddings[image.hash][first:end] for image, first, end, _ in pieces]
    return torch.cat(chunks), torch.from_numpy(rows).to(device)


def _embeddings(
    images: list[ImageInput], model: torch.nn.Module, cache: EncoderCache, device: torch.device
) -> dict[str, torch.Tensor]:
    """Each image's embeddings ``[length, hidden]`` by hash: cached ones, the rest encoded in one batch."""
    found: dict[str, torch.Tensor] = {}
    missing: dict[str, ImageInput] = {}
    for image in images:
        if image.hash in found or image.hash in missing:
            continue
        cached = cache.get(image.hash)
        if cached is None:
            missing[image.hash] = image
        else:
            found[image.hash] = cached
    if missing:
        pixels = torch.from_numpy(np.stack([image.pixel_values for image in missing.values()])).to(device)
        encoded = model.encode_images(pixels)  # [B, length, hidden]
        for image_hash, rows in zip(missing, encoded):
            found[image_hash] = rows = rows.clone()  # its own storage, not a view of the batch's
            cache.add(image_hash, rows, rows.numel() * rows.element_size())
    return found
