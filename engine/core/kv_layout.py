"""What a persisted KV block's bytes depend on besides its tokens (``KVLayout``), and how they split over the
ranks of a tensor- and pipeline-parallel group (``KVShard``).

A block's payload is K and V for every layer the KV cache holds, ``[layer, k|v, slot, kv_head, dim]``. Under
tensor or pipeline parallelism each rank holds its share of a block: its stage's layers, its share of their KV
heads. The payload is then every rank's part, in rank order (rank ``stage * tp + i``), each laid out the same
way; ``KVLayout.shards`` says each part's shape, so a split over ranks is a layout of its own (another key) and
blocks load only into the split that wrote them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from hashlib import blake2b
from pathlib import Path
from typing import Any, NamedTuple

_SAMPLES_PER_FILE = 16  # chunks of each weight file a model fingerprint reads
_SAMPLE_BYTES = 64 << 10


class KVShard(NamedTuple):
    """One rank's part of every block: the KV cache it holds (``ModelRunner.kv_shard``)."""

    tp_rank: int
    stage: int  # the pipeline stage
    num_layers: int  # its stage's layers a block holds
    num_kv_heads: int  # its KV heads (a replicated one counts on each rank that holds it)


@dataclass(frozen=True)
class KVLayout:
    """Everything a block's K/V bytes depend on besides its tokens: blocks load only into the same layout.

    ``num_layers`` and ``num_kv_heads`` are one process's cache; a sharded layout's (``shards``) are the first
    stage's first rank's, the parts' shapes being the shards'.
    """

    model: str  # model_fingerprint() of the weights and config
    kv_dtype: str  # the KV cache's element type
    compute_dtype: str
    weight_dtype: str
    quantization: str | None
    attention_backend: str  # the backend class: kernels may round differently
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    byteorder: str
    tensor_layout: str = "layer, k|v, slot, kv_head, dim"  # of one block's payload (of each rank's part)
    shards: tuple[KVShard, ...] = ()  # each rank's part, in rank order; () = one process holds the whole block

    def describe(self) -> dict[str, Any]:
        """The fields the key stands for (``shards`` only where the layout has them: one process's keys are
        those of the releases before sharded layouts)."""
        fields = asdict(self)
        if not self.shards:
            del fields["shards"]
        return fields

    @property
    def key(self) -> str:
        """32 hex digits naming the layout's directory."""
        text = json.dumps(self.describe(), sort_keys=True)
        return blake2b(text.encode(), digest_size=16).hexdigest()

    @property
    def shard_bytes(self) -> list[int]:
        """Each rank's payload bytes of one block, in rank order (one entry: one process)."""
        if not self.shards:
            return [self._part_bytes(self.num_layers, self.num_kv_heads)]
        return [self._part_bytes(shard.num_layers, shard.num_kv_heads) for shard in self.shards]

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block: the ranks' layers x 2 x block_size x KV heads x head_dim x dtype bytes."""
        return sum(self.shard_bytes)

    def _part_bytes(self, num_layers: int, num_kv_heads: int) -> int:
        return num_layers * 2 * self.block_size * num_kv_heads * self.head_dim * self.dtype_bytes


def split_payload(payload: bytes | memoryview, sizes: Sequence[int]) -> list[memoryview]:
    """A block's payload cut into its ranks' parts of ``sizes`` bytes (``KVLayout.shard_bytes``).

    Raises:
        ValueError: the payload is not the parts' sum.
    """
    view = memoryview(payload)
    if len(view) != sum(sizes):
        raise ValueError(f"a payload of {len(view)} bytes is not its ranks' parts of {list(sizes)} bytes")
    parts, start = [], 0
    for size in sizes:
        parts.append(view[start : start + size])
        start += size
    return parts


def model_fingerprint(config_file: Path, weight_files: Sequence[Path]) -> str:
    """A digest of a model's config and weights: the files' names, sizes and 16 chunks of 64 KiB of each.

    Reading samples keeps it to ~1 MiB per file; any fine-tune or re-quantization changes the
    sampled bytes, where names and sizes alone would not.
    """
    digest = blake2b(config_file.read_bytes(), digest_size=16)
    for path in sorted(weight_files, key=lambda p: p.name):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for i in range(_SAMPLES_PER_FILE):
                f.seek(max(0, (size - _SAMPLE_BYTES) * i // (_SAMPLES_PER_FILE - 1)))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()
