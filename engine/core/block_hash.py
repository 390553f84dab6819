"""Prefix-block hashes: a full block's identity, chained over its parent.

A full block's hash covers (parent block's hash, extra keys, its token ids). Two
blocks have the same hash exactly when they hold the same tokens after the same
prefix under the same extra keys (cache salt, adapter, multimodal input id), so
they hold the same K/V and one physical block can serve both.

NOTE: hashes are 128-bit keyed BLAKE2b digests over the packed token ids, never
Python's ``hash()``. The KV cache manager relies on them without re-checking the
token ids on a hit: a collision among 2**32 cached blocks has probability ~2**-64.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import blake2b

BlockHash = bytes  # 16-byte digest
ExtraKey = str | int | bytes
MultiModalSpan = tuple[int, int, str]  # an image's (first position, number of tokens, content hash)

HASH_SIZE = 16
_ROOT_PARENT = blake2b(b"paged.kv.block.root", digest_size=HASH_SIZE).digest()  # the first block's parent
_TOKEN_BYTES = 8  # token ids are packed as little-endian int64: the same hash on every platform


def encode_extra_keys(extra_keys: Sequence[ExtraKey] | None) -> bytes:
    """Packs extra keys into bytes that no other key tuple packs into (type-tagged, length-prefixed)."""
    if not extra_keys:
        return b""
    parts = []
    for key in extra_keys:
        if isinstance(key, bytes):
            tag, raw = b"b", key
        elif isinstance(key, str):
            tag, raw = b"s", key.encode()
        elif isinstance(key, int) and not isinstance(key, bool):
            tag, raw = b"i", str(key).encode()
        else:
            raise TypeError(f"extra keys must be str, int or bytes; got {type(key).__name__}")
        parts.append(tag + len(raw).to_bytes(4, "little") + raw)
    return b"".join(parts)


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] | None = None,
) -> BlockHash:
    """Hashes one full block.

    Args:
        parent_hash: The previous block's hash; None for a request's first block.
        token_ids: The block's token ids.
        extra_keys: Whatever else changes the block's K/V (cache salt, adapter id, ...).

    Returns:
        The block's 16-byte hash.
    """
    return _hash_packed(parent_hash, _pack(token_ids), encode_extra_keys(extra_keys))


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    cache_salt: str | None = None,
    mm_spans: Sequence[MultiModalSpan] = (),
) -> None:
    """Appends the hashes of the full blocks within ``token_ids[:num_tokens]`` not hashed yet.

    Work is proportional to the new blocks only, so a running request pays nothing on
    the steps that do not fill a block.

    NOTE: ``cache_salt`` enters the first block only; the chain carries it to the rest. An image
    (``mm_spans``, by position) enters the hash of every block that holds some of its tokens, as its
    content hash and its offset from the block's start: its placeholder tokens alone say nothing of it.
    """
    start = len(block_hashes)
    stop = min(num_tokens, len(token_ids)) // block_size
    if stop <= start:
        return
    packed = memoryview(_pack(token_ids[start * block_size : stop * block_size]))
    stride = block_size * _TOKEN_BYTES
    parent = block_hashes[-1] if block_hashes else None
    for i in range(stop - start):
        keys: list[ExtraKey] = [cache_salt] if (start + i == 0 and cache_salt is not None) else []
        if mm_spans:
            keys += block_image_keys(mm_spans, (start + i) * block_size, block_size)
        extra = encode_extra_keys(keys)
        parent = _hash_packed(parent, packed[i * stride : (i + 1) * stride], extra)
        block_hashes.append(parent)


def block_image_keys(mm_spans: Sequence[MultiModalSpan], block_start: int, block_size: int) -> list[ExtraKey]:
    """The extra keys of the block at ``block_start``: (hash, offset from the block's start) of each image it holds
    tokens of, in position order; empty for a block of text only."""
    keys: list[ExtraKey] = []
    for offset, length, content_hash in mm_spans:
        if offset < block_start + block_size and offset + length > block_start:
            keys += (content_hash, offset - block_start)
    return keys


def group_block_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The hash-index key of a block of KV cache group ``group``: the block's hash for group 0, else the
    hash and the group, so two groups' blocks of the same tokens (other layers' K/V) never alias."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


def _hash_packed(parent_hash: BlockHash | None, packed_ids: bytes | memoryview, extra: bytes) -> BlockHash:
    parent = parent_hash if parent_hash is not None else _ROOT_PARENT
    message = b"".join((parent, len(extra).to_bytes(4, "little"), extra, packed_ids))  # one C call to hash
    return blake2b(message, digest_size=HASH_SIZE).digest()


def _pack(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}q", *token_ids)  # ~2x faster than array("q", list)
