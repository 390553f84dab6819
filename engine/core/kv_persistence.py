"""KV blocks on disk: which cached blocks are saved, the file format, the layout they belong to, and the
checks on load.

``BlockOrigins`` keeps what each full block's hash was computed from (its ``BlockOrigin``), as the KV cache
manager registers the block, and chooses the blocks worth saving: the pinned prefixes' and the hottest others,
each with the ancestors it needs to be hit.

A directory (``EngineConfig.kv_cache_dir``) holds blocks of any number of layouts::

    kv_cache_dir/
      <layout key>/                     one per KVLayout (model, dtypes, block size, shape, split over ranks)
        layout.json                     what the key stands for, for people; the key is what is checked
        shared/<block hash>.kvb         blocks of requests without a cache salt
        salt-<salt digest>/<hash>.kvb   blocks of one cache salt

One file per full block, named by its hash::

    "PAGEDKV" | format version (1 byte, FORMAT_VERSION) | header length (u32 LE) | header (JSON) | payload
        | BLAKE2b-256 of all before

The header holds the layout key, the block's hash, its parent's hash, the chain's cache salt,
the block's token ids and its image keys (the hash of each image it holds tokens of and the
image's offset from the block's start, as they entered the block's hash); the payload is the
block's K and V for every layer, as the runner's ``read_kv_blocks`` gives them (under tensor or pipeline
parallelism every rank's part, in rank order: ``engine.core.kv_layout``), so a file holds a block whole
or is skipped whole. A file is
written to a temporary name and renamed, so a crash mid-write leaves the old file or none.

On load a file counts only if its format version, checksum, layout key and payload size match,
its name and directory match its header, and its hash recomputes from (parent hash, tokens,
salt, image keys): a file cannot claim a hash it does not have, so it is served only to
prompts with its exact prefix and images under its exact salt. A block also needs its parent
loaded (from the same salt's directory). A file of another format version is skipped (and
removed by the next save). Pure Python: the engine moves the payloads in and out of the KV
tensors.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from typing import NamedTuple

from engine.core.block_hash import BlockHash, ExtraKey, hash_block_tokens
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_layout import KVLayout

FORMAT_VERSION = 2  # 2: headers hold image keys (1: tokens and salt only)
MAGIC = b"PAGEDKV" + bytes([FORMAT_VERSION])
SUFFIX = ".kvb"
CHECKSUM_SIZE = 32
_HEADER_LEN = struct.Struct("<I")
_Key = tuple[str, BlockHash]  # (salt directory, block hash): a block's identity on disk


ANOTHER_FORMAT = "another format version"  # a skip reason that is no damage (files of an older release)


class BlockOrigin(NamedTuple):
    """What a full block's hash is computed from: enough to recompute it, so to persist the block."""

    parent_hash: BlockHash | None  # None for a chain's first block
    token_ids: tuple[int, ...]
    cache_salt: str | None  # the chain's salt (it enters the first block's hash only)
    image_keys: tuple[ExtraKey, ...] = ()  # (image hash, offset from the block's start) of each image it holds


class BlockOrigins:
    """The origin of every full block ``kv`` registers from now on, and the cached blocks worth persisting.

    The origins are pruned to the blocks still cached once they number twice the pool's blocks.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.origins: dict[BlockHash, BlockOrigin] = {}
        kv.block_listener = self._registered

    def restore_cached_block(self, block_hash: BlockHash, origin: BlockOrigin) -> int | None:
        """Registers a block read back from disk as cached, with its origin (``KVCacheManager.restore_cached_block``).

        Returns:
            The block's id; None when the pool has no free block or the hash is cached already.
        """
        block_id = self.kv.restore_cached_block(block_hash)
        if block_id is not None:
            self.origins[block_hash] = origin
        return block_id

    def persistable_blocks(self, req_ids: Sequence[str], num_hot: int) -> list[tuple[int, BlockHash, BlockOrigin]]:
        """The cached blocks worth persisting, each after its parent, as (block id, hash, origin).

        First every registered full block of ``req_ids`` (pinned prefixes); then up to ``num_hot``
        more, the most recently used first (referenced blocks, then the evictable ones most
        recently freed first), each with the ancestors it needs to be hit. A block whose chain
        is no longer cached whole, or whose origin was not tracked, is left out.
        """
        origins, pool = self.origins, self.kv.block_pool
        chosen: dict[BlockHash, tuple[int, BlockOrigin]] = {}

        def chain_to(block_hash: BlockHash) -> list[tuple[BlockHash, int, BlockOrigin]] | None:
            """The blocks from ``block_hash`` back to the first one not chosen yet, deepest first; None if broken."""
            chain: list[tuple[BlockHash, int, BlockOrigin]] = []
            current: BlockHash | None = block_hash
            while current is not None and current not in chosen:
                block, origin = pool.get_cached_block(current), origins.get(current)
                if block is None or origin is None:
                    return None
                chain.append((current, block.block_id, origin))
                current = origin.parent_hash
            return chain

        def choose(chain: list[tuple[BlockHash, int, BlockOrigin]]) -> None:
            for block_hash, block_id, origin in reversed(chain):
                chosen[block_hash] = (block_id, origin)

        for req_id in req_ids:
            for block_hash in self.kv.cached_block_hashes(req_id):
                chain = chain_to(block_hash)
                if chain is None:
                    break
                choose(chain)
        budget = num_hot
        referenced = (block.block_id for block in pool.blocks if block.ref_cnt > 0 and block.block_hash is not None)
        for block_id in itertools.chain(referenced, reversed(pool.evictable)):
            if budget <= 0:
                break
            block_hash = pool.blocks[block_id].block_hash
            chain = chain_to(block_hash) if block_hash is not None else None
            if chain and len(chain) <= budget:
                choose(chain)
                budget -= len(chain)
        return [(block_id, block_hash, origin) for block_hash, (block_id, origin) in chosen.items()]

    def _registered(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None,
        image_keys: Sequence[ExtraKey],
    ) -> None:  # fmt: skip
        if len(self.origins) >= 2 * self.kv.num_blocks:  # NOTE: amortised O(1) per block registered
            index = self.kv.block_pool.cached_block_hash_to_id
            self.origins = {h: o for h, o in self.origins.items() if h in index}
        self.origins[block_hash] = BlockOrigin(parent_hash, tuple(token_ids), cache_salt, tuple(image_keys))


class CorruptBlockFile(ValueError):
    """A block file that fails a check on load; the message says which (it is the skip reason)."""


def salt_dir_name(cache_salt: str | None) -> str:
    """The directory of a salt's blocks: ``shared``, or ``salt-`` and a digest (the salt is not in the name)."""
    if cache_salt is None:
        return "shared"
    return "salt-" + blake2b(cache_salt.encode(), digest_size=12).hexdigest()


def encode_block(layout_key: str, block_hash: BlockHash, origin: BlockOrigin, payload: bytes) -> bytes:
    """One block file's bytes."""
    header = json.dumps({
        "layout": layout_key,
        "hash": block_hash.hex(),
        "parent": None if origin.parent_hash is None else origin.parent_hash.hex(),
        "salt": origin.cache_salt,
        "tokens": list(origin.token_ids),
        "images": list(origin.image_keys),
    }).encode()  # fmt: skip
    body = b"".join((MAGIC, _HEADER_LEN.pack(len(header)), header, payload))
    return body + blake2b(body, digest_size=CHECKSUM_SIZE).digest()


def decode_block(data: bytes, layout: KVLayout) -> tuple[BlockHash, BlockOrigin, memoryview]:
    """A block file's hash, origin and payload, every check passed.

    Raises:
        CorruptBlockFile: torn, another format version, checksum mismatch, another layout, wrong sizes, or a
            hash that does not recompute from its parent, tokens, salt and image keys.
    """
    view = memoryview(data)
    fixed = len(MAGIC) + _HEADER_LEN.size
    if len(data) < fixed + CHECKSUM_SIZE or view[: len(MAGIC) - 1] != MAGIC[:-1]:
        raise CorruptBlockFile("torn or not a block file")
    if view[len(MAGIC) - 1] != FORMAT_VERSION:
        raise CorruptBlockFile(ANOTHER_FORMAT)
    if blake2b(view[:-CHECKSUM_SIZE], digest_size=CHECKSUM_SIZE).digest() != view[-CHECKSUM_SIZE:]:
        raise CorruptBlockFile("checksum mismatch")
    (header_len,) = _HEADER_LEN.unpack_from(view, len(MAGIC))
    try:
        header = json.loads(bytes(view[fixed : fixed + header_len]))
        block_hash = bytes.fromhex(header["hash"])
        parent = None if header["parent"] is None else bytes.fromhex(header["parent"])
        origin = BlockOrigin(
            parent, tuple(int(t) for t in header["tokens"]), header["salt"], _image_keys(header["images"])
        )
        layout_key = header["layout"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptBlockFile(f"unreadable header ({type(exc).__name__})") from None
    if layout_key != layout.key:
        raise CorruptBlockFile("another layout")
    payload = view[fixed + header_len : -CHECKSUM_SIZE]
    if len(payload) != layout.block_bytes or len(origin.token_ids) != layout.block_size:
        raise CorruptBlockFile("wrong size")
    salt = () if parent is not None or origin.cache_salt is None else (origin.cache_salt,)
    if not isinstance(origin.cache_salt, (str, type(None))) or (
        hash_block_tokens(parent, origin.token_ids, (*salt, *origin.image_keys)) != block_hash
    ):
        raise CorruptBlockFile("hash does not match its tokens")
    return block_hash, origin, payload


def _image_keys(value: object) -> tuple[ExtraKey, ...]:
    """A header's image keys: (image hash, offset) pairs, flattened as they enter the block's hash."""
    if not isinstance(value, list) or len(value) % 2:
        raise TypeError("image keys must be a list of (hash, offset) pairs")
    pairs = zip(value[::2], value[1::2])
    if not all(isinstance(h, str) and isinstance(o, int) and not isinstance(o, bool) for h, o in pairs):
        raise TypeError("image keys must be a list of (hash, offset) pairs")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class LoadedBlock:
    block_hash: BlockHash
    origin: BlockOrigin
    payload: memoryview


class KVBlockStore:
    """The blocks of one layout under a ``kv_cache_dir``: loads the valid ones, mirrors a selection on save.

    Not thread-safe; one engine at a time per directory (two engines of one layout would
    remove each other's files, never serve wrong ones).

    Args:
        root: ``kv_cache_dir``; created if missing.
        layout: the layout of this engine's KV cache.

    Raises:
        OSError: ``root`` cannot be created or written.
    """

    def __init__(self, root: str | os.PathLike[str], layout: KVLayout) -> None:
        self.root = Path(root)
        self.layout = layout
        self.dir = self.root / layout.key
        self.dir.mkdir(parents=True, exist_ok=True)
        descriptor = self.dir / "layout.json"
        if not descriptor.exists():
            _write_atomic(descriptor, json.dumps(layout.describe(), indent=1, sort_keys=True).encode())
        self._on_disk: set[str] = set()  # files known valid: "salt dir/hash.kvb"

    def load(self, max_blocks: int) -> tuple[Iterator[LoadedBlock], Counter[str]]:
        """The valid blocks whose whole chain is valid, each after its parent, at most ``max_blocks``.

        Returns:
            The blocks, read lazily and each checked again as it is read (a file changed since
            the scan is skipped with its descendants); and the reasons files were skipped, by
            count, complete once the blocks are consumed.
        """
        skipped: Counter[str] = Counter()
        for other in self.root.iterdir():
            if other.is_dir() and other.name != self.layout.key:
                skipped["another layout"] += sum(1 for _ in other.rglob(f"*{SUFFIX}"))
        found: dict[_Key, tuple[BlockOrigin, Path]] = {}
        for path in sorted(self.dir.glob(f"*/*{SUFFIX}")):
            try:
                block_hash, origin = self._read(path)[:2]
            except CorruptBlockFile as exc:
                skipped[str(exc)] += 1
                continue
            found[path.parent.name, block_hash] = origin, path
        depth = _chain_depths(found)
        ordered = sorted((k for k in found if depth[k] is not None), key=lambda k: depth[k])
        skipped["parent missing"] += len(found) - len(ordered)
        skipped["no room in the KV cache"] += len(ordered) - max_blocks
        skipped = +skipped  # NOTE: only the reasons that occurred
        for salt_dir, block_hash in ordered[:max_blocks]:
            self._on_disk.add(f"{salt_dir}/{block_hash.hex()}{SUFFIX}")
        return self._read_ordered([found[k][1] for k in ordered[:max_blocks]], skipped), skipped

    def save(
        self, blocks: Sequence[tuple[int, BlockHash, BlockOrigin]], read: Callable[[list[int]], list[bytes]]
    ) -> int:
        """Makes the layout's directory hold exactly ``blocks``: writes the missing files, removes the others.

        Args:
            blocks: (block id, hash, origin) of each block to keep.
            read: the payloads of block ids, in order (called once, for the missing files only).

        Returns:
            The files written.
        """
        wanted = {f"{salt_dir_name(origin.cache_salt)}/{block_hash.hex()}{SUFFIX}": (block_id, block_hash, origin)
                  for block_id, block_hash, origin in blocks}  # fmt: skip
        missing = [name for name in wanted if name not in self._on_disk]
        payloads = read([wanted[name][0] for name in missing]) if missing else []
        for name, payload in zip(missing, payloads):
            _, block_hash, origin = wanted[name]
            path = self.dir / name
            path.parent.mkdir(exist_ok=True)
            _write_atomic(path, encode_block(self.layout.key, block_hash, origin, payload))
            self._on_disk.add(name)
        for path in self.dir.glob(f"*/*{SUFFIX}"):
            name = f"{path.parent.name}/{path.name}"
            if name not in wanted:
                path.unlink(missing_ok=True)
                self._on_disk.discard(name)
        return len(missing)

    def _read(self, path: Path) -> tuple[BlockHash, BlockOrigin, memoryview]:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CorruptBlockFile(f"unreadable ({exc.strerror})") from None
        block_hash, origin, payload = decode_block(data, self.layout)
        if path.name != block_hash.hex() + SUFFIX or path.parent.name != salt_dir_name(origin.cache_salt):
            raise CorruptBlockFile("misplaced")
        return block_hash, origin, payload

    def _read_ordered(self, paths: list[Path], skipped: Counter[str]) -> Iterator[LoadedBlock]:
        dropped: set[BlockHash] = set()
        for path in paths:
            try:
                block_hash, origin, payload = self._read(path)
            except CorruptBlockFile as exc:
                skipped[f"{exc} (changed since the scan)"] += 1
                self._on_disk.discard(f"{path.parent.name}/{path.name}")
                dropped.add(bytes.fromhex(path.stem))
                continue
            if origin.parent_hash in dropped:
                skipped["parent missing"] += 1
                dropped.add(block_hash)
                continue
            yield LoadedBlock(block_hash, origin, payload)


def _chain_depths(found: dict[_Key, tuple[BlockOrigin, Path]]) -> dict[_Key, int | None]:
    """Each block's position in its chain (0 for a first block); None where an ancestor is missing (or loops)."""
    depth: dict[_Key, int | None] = {}
    for start in found:
        chain: list[_Key] = []
        seen: set[_Key] = set()
        key: _Key = start
        while True:
            if key in depth:
                base = depth[key]
                break
            if key not in found or key in seen:
                base = None
                break
            chain.append(key)
            seen.add(key)
            parent = found[key][0].parent_hash
            if parent is None:
                base = -1
                break
            key = (key[0], parent)
        for key in reversed(chain):
            base = None if base is None else base + 1
            depth[key] = base
    return depth


def _write_atomic(path: Path, data: bytes) -> None:
    """Writes ``path`` through a temporary file and a rename: readers see the old file or the new, whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
