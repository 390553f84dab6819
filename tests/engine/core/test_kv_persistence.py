"""KV blocks on disk: what is chosen, the file format's checks, and restoring into a pool (no tensors)."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path

import pytest

from engine.core.block_hash import extend_block_hashes
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_layout import KVShard, model_fingerprint, split_payload
from engine.core.kv_persistence import (
    MAGIC,
    BlockOrigin,
    BlockOrigins,
    CorruptBlockFile,
    KVBlockStore,
    KVLayout,
    decode_block,
    encode_block,
    salt_dir_name,
)

BS = 4
LAYOUT = KVLayout(
    model="m", kv_dtype="torch.float32", compute_dtype="torch.float32", weight_dtype="torch.float32",
    quantization=None, attention_backend="Torch", block_size=BS, num_layers=2, num_kv_heads=1, head_dim=2,
    dtype_bytes=4, byteorder="little",
)  # fmt: skip
SYSTEM = list(range(100, 100 + 3 * BS + 1))  # 3 full blocks and one token


def admit(
    kv: KVCacheManager, req_id: str, token_ids: list[int], cache_salt: str | None = None, mm_spans: tuple = ()
) -> list[int]:
    computed = kv.get_computed_blocks(req_id, token_ids, cache_salt, mm_spans)
    num_new = len(token_ids) - computed.num_computed_tokens
    tables = kv.allocate_slots(
        req_id, token_ids, computed.num_computed_tokens, num_new, computed, cache_salt, mm_spans=mm_spans
    )
    assert tables is not None
    (table,) = tables  # one full-attention group
    return table


def payload_of(block_id: int) -> bytes:
    """A block's fake K/V: its id repeated, so a test sees which block a payload came from."""
    return bytes([block_id % 256]) * LAYOUT.block_bytes


def tracked(num_blocks: int = 16) -> BlockOrigins:
    """The origins of a fresh manager's blocks (the manager is its ``kv``)."""
    return BlockOrigins(KVCacheManager(num_blocks, block_size=BS))


def test_pinned_chain_then_hottest_blocks_each_after_its_parent() -> None:
    """Pinned blocks come first and whole; hot blocks are added most recent first, with their ancestors,
    within the budget; an untracked or evicted chain is left out."""
    origins = tracked()
    kv = origins.kv
    pin = admit(kv, "pin", SYSTEM)
    admit(kv, "a", list(range(500, 500 + 2 * BS)))
    kv.free("a")
    admit(kv, "b", list(range(700, 700 + 2 * BS)))
    kv.free("b")
    chosen = origins.persistable_blocks(["pin"], num_hot=0)
    assert [block_id for block_id, _, _ in chosen] == pin[:3]
    parents = [origin.parent_hash for _, _, origin in chosen]
    assert parents == [None, chosen[0][1], chosen[1][1]]
    assert [origin.token_ids for _, _, origin in chosen] == [tuple(SYSTEM[i * BS : (i + 1) * BS]) for i in range(3)]

    def first_tokens(req_ids: list[str], num_hot: int) -> list[int]:
        return [origin.token_ids[0] for _, _, origin in origins.persistable_blocks(req_ids, num_hot)]

    # hot: referenced blocks first, then cached ones most recently freed first ("b", freed last, head first)
    assert first_tokens([], 5) == [100, 104, 108, 700, 704]
    assert first_tokens(["pin"], 1) == [100, 104, 108, 700]
    assert first_tokens(["unknown"], 0) == []
    kv.free("pin")
    origins.origins.pop(chosen[0][1])  # an untracked head: its chain cannot be saved
    assert first_tokens(["pin"], 16) == [700, 704, 500, 504]
    kv.check_integrity()


def test_salted_chain_keeps_its_salt_and_hashes() -> None:
    origins = tracked()
    kv = origins.kv
    admit(kv, "t", SYSTEM, cache_salt="tenant-a")
    chosen = origins.persistable_blocks(["t"], 0)
    assert {origin.cache_salt for _, _, origin in chosen} == {"tenant-a"}
    hashes: list[bytes] = []
    extend_block_hashes(hashes, SYSTEM, len(SYSTEM), BS, "tenant-a")
    assert [h for _, h, _ in chosen] == hashes[:3]


def test_block_file_round_trips_and_every_check_refuses_damage() -> None:
    origins = tracked()
    kv = origins.kv
    admit(kv, "p", SYSTEM)
    (block_id, block_hash, origin), (_, child_hash, child_origin) = origins.persistable_blocks(["p"], 0)[:2]
    data = encode_block(LAYOUT.key, block_hash, origin, payload_of(block_id))
    assert decode_block(data, LAYOUT) == (block_hash, origin, payload_of(block_id))

    def refused(blob: bytes, layout: KVLayout = LAYOUT) -> str:
        with pytest.raises(CorruptBlockFile) as err:
            decode_block(blob, layout)
        return str(err.value)

    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    assert refused(bytes(flipped)) == "checksum mismatch"
    assert refused(data[: len(data) - 7]) == "checksum mismatch"
    assert refused(data[:10]) == "torn or not a block file"
    assert refused(data, dataclasses.replace(LAYOUT, kv_dtype="torch.bfloat16", dtype_bytes=2)) == "another layout"
    # a file that claims a hash its tokens do not give (its checksum recomputed to match)
    lying = encode_block(LAYOUT.key, child_hash, origin, payload_of(block_id))
    assert refused(lying) == "hash does not match its tokens"
    salted = encode_block(LAYOUT.key, block_hash, origin._replace(cache_salt="other"), payload_of(block_id))
    assert refused(salted) == "hash does not match its tokens"
    short = encode_block(LAYOUT.key, child_hash, child_origin, payload_of(block_id)[:-4])
    assert refused(short) == "wrong size"


IMAGE = (BS + 2, BS + 1, "a" * 32)  # an image's tokens from position 6 to 10: in blocks 1 and 2 (after a text block)


def test_image_blocks_persist_with_their_image_keys_and_load_for_that_image_only(tmp_path: Path) -> None:
    """Each block file of an image's blocks records the image keys its hash took; a restored chain is a hit for the
    same tokens and image, another image with the same tokens hits only the text block before it."""
    origins = tracked()
    kv = origins.kv
    admit(kv, "p", SYSTEM, mm_spans=(IMAGE,))
    chosen = origins.persistable_blocks(["p"], 0)
    assert [origin.image_keys for _, _, origin in chosen] == [(), (IMAGE[2], 2), (IMAGE[2], -2)]
    (block_id, block_hash, origin) = chosen[1]
    data = encode_block(LAYOUT.key, block_hash, origin, payload_of(block_id))
    assert decode_block(data, LAYOUT) == (block_hash, origin, payload_of(block_id))
    for lie in ((), ("b" * 32, 2), (IMAGE[2], 3)):  # no image, another image, another offset: the hash refutes it
        with pytest.raises(CorruptBlockFile, match="hash does not match its tokens"):
            decode_block(encode_block(LAYOUT.key, block_hash, origin._replace(image_keys=lie), payload_of(block_id)), LAYOUT)
    with pytest.raises(CorruptBlockFile, match="unreadable header"):  # an offset that is no int
        decode_block(encode_block(LAYOUT.key, block_hash, origin._replace(image_keys=(IMAGE[2], "2")), b""), LAYOUT)
    saved_store(tmp_path, origins, ["p"])
    fresh, restored, skipped = restore(tmp_path)
    assert len(restored) == 3 and not skipped
    assert fresh.get_computed_blocks("q", SYSTEM, None, (IMAGE,)).num_computed_tokens == 3 * BS
    assert fresh.get_computed_blocks("r", SYSTEM, None, ((*IMAGE[:2], "b" * 32),)).num_computed_tokens == BS
    assert fresh.get_computed_blocks("s", SYSTEM).num_computed_tokens == BS


def test_files_of_another_format_version_are_skipped_and_replaced_by_the_next_save(tmp_path: Path) -> None:
    origins = tracked()
    kv = origins.kv
    admit(kv, "p", SYSTEM)
    store = saved_store(tmp_path, origins, ["p"])
    assert MAGIC == b"PAGEDKV\x02"
    for path in store.dir.glob("*/*.kvb"):  # as the release before image keys wrote them
        path.write_bytes(b"PAGEDKV\x01" + path.read_bytes()[len(MAGIC) :])
    _, restored, skipped = restore(tmp_path)
    assert not restored and skipped == {"another format version": 3}
    saved_store(tmp_path, origins, ["p"])  # a fresh store writes every block again
    _, restored, skipped = restore(tmp_path)
    assert len(restored) == 3 and not skipped


def saved_store(tmp_path: Path, origins: BlockOrigins, req_ids: list[str], num_hot: int = 0) -> KVBlockStore:
    store = KVBlockStore(tmp_path, LAYOUT)
    blocks = origins.persistable_blocks(req_ids, num_hot)
    assert store.save(blocks, lambda ids: [payload_of(i) for i in ids]) == len(blocks)
    return store


def restore(tmp_path: Path, num_blocks: int = 16) -> tuple[KVCacheManager, list[tuple[int, bytes]], dict[str, int]]:
    """A fresh manager with the directory's blocks restored: (manager, [(block id, payload)], skip reasons)."""
    origins = tracked(num_blocks)
    kv = origins.kv
    blocks, skipped = KVBlockStore(tmp_path, LAYOUT).load(kv.block_pool.num_free_blocks)
    restored = []
    for block in blocks:
        block_id = origins.restore_cached_block(block.block_hash, block.origin)
        assert block_id is not None
        restored.append((block_id, bytes(block.payload)))
    kv.check_integrity()
    return kv, restored, dict(skipped)


def test_restored_blocks_are_hits_for_the_same_prefix_and_salt_only(tmp_path: Path) -> None:
    origins = tracked()
    kv = origins.kv
    pin = admit(kv, "pin", SYSTEM)
    admit(kv, "tenant", list(range(900, 900 + 2 * BS + 1)), cache_salt="a")
    saved_store(tmp_path, origins, ["pin", "tenant"])
    assert Counter(p.parent.name for p in tmp_path.rglob("*.kvb")) == {"shared": 3, salt_dir_name("a"): 2}

    fresh, restored, skipped = restore(tmp_path)
    assert skipped == {} and len(restored) == 5
    pool = fresh.block_pool
    assert pool.num_cached_blocks == 5 and pool.num_used_blocks == 0
    hit = fresh.get_computed_blocks("again", SYSTEM + [1, 2])
    assert hit.num_computed_tokens == 3 * BS
    # the payload restored into each hit block is the one saved from the same prefix's block
    payload = dict(restored)
    assert [payload[i] for i in hit.block_ids[0]] == [payload_of(i) for i in pin[:3]]
    salted = list(range(900, 900 + 2 * BS + 1))
    assert fresh.get_computed_blocks("a2", salted, "a").num_computed_tokens == 2 * BS
    assert fresh.get_computed_blocks("b", salted, "b").num_computed_tokens == 0
    assert fresh.get_computed_blocks("none", salted).num_computed_tokens == 0
    # restored blocks are evicted first, a chain's tail before its head; the pool stays whole
    admit(fresh, "again", SYSTEM + [1, 2], None)
    fresh.free("again")
    fresh.check_integrity()
    assert fresh.block_pool.num_free_blocks == 16


def test_damaged_files_are_skipped_with_their_descendants(tmp_path: Path) -> None:
    origins = tracked()
    kv = origins.kv
    admit(kv, "pin", SYSTEM)
    admit(kv, "other", list(range(600, 600 + BS + 1)))
    saved_store(tmp_path, origins, ["pin", "other"])
    middle = next(p for p in tmp_path.rglob("*.kvb") if decode_block(p.read_bytes(), LAYOUT)[1].token_ids[0] == SYSTEM[BS])
    data = bytearray(middle.read_bytes())
    data[100] ^= 0x01
    middle.write_bytes(bytes(data))
    (tmp_path / ("f" * 32)).mkdir()
    (tmp_path / ("f" * 32) / "x.kvb").write_bytes(b"another model")
    fresh, restored, skipped = restore(tmp_path)
    assert skipped == {"checksum mismatch": 1, "parent missing": 1, "another layout": 1}
    assert len(restored) == 2  # SYSTEM's first block and "other"'s
    assert fresh.get_computed_blocks("x", SYSTEM).num_computed_tokens == BS


def test_truncated_file_and_a_file_changed_after_the_scan(tmp_path: Path) -> None:
    origins = tracked()
    kv = origins.kv
    admit(kv, "pin", SYSTEM)
    saved_store(tmp_path, origins, ["pin"])
    root = next(p for p in tmp_path.rglob("*.kvb") if decode_block(p.read_bytes(), LAYOUT)[1].parent_hash is None)
    store = KVBlockStore(tmp_path, LAYOUT)
    blocks, skipped = store.load(16)
    root.write_bytes(root.read_bytes()[:-100])  # torn after the scan: it and its chain go
    assert list(blocks) == []
    assert dict(skipped) == {"checksum mismatch (changed since the scan)": 1, "parent missing": 2}


def test_save_mirrors_the_selection_and_writes_only_new_blocks(tmp_path: Path) -> None:
    origins = tracked()
    kv = origins.kv
    admit(kv, "pin", SYSTEM)
    store = saved_store(tmp_path, origins, ["pin"])
    reads: list[list[int]] = []

    def read(ids: list[int]) -> list[bytes]:
        reads.append(ids)
        return [payload_of(i) for i in ids]

    assert store.save(origins.persistable_blocks(["pin"], 0), read) == 0 and reads == []
    admit(kv, "more", SYSTEM[:-1] + list(range(50, 50 + BS + 1)))
    assert store.save(origins.persistable_blocks(["more"], 0), read) == 1 and len(reads[0]) == 1
    assert len(list(tmp_path.rglob("*.kvb"))) == 4
    assert store.save([], read) == 0
    assert not list(tmp_path.rglob("*.kvb")) and not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_restore_takes_free_blocks_only(tmp_path: Path) -> None:
    origins = tracked()
    kv = origins.kv
    admit(kv, "pin", SYSTEM)
    saved_store(tmp_path, origins, ["pin"])
    fresh, restored, skipped = restore(tmp_path, num_blocks=2)
    assert len(restored) == 2 and skipped == {"no room in the KV cache": 1}
    full = tracked(2)
    admit(full.kv, "x", list(range(2 * BS)))
    assert full.restore_cached_block(b"\0" * 16, BlockOrigin(None, (1,) * BS, None)) is None


def test_model_fingerprint_sees_changed_weights(tmp_path: Path) -> None:
    config, weights = tmp_path / "config.json", tmp_path / "model.safetensors"
    config.write_text("{}")
    weights.write_bytes(os.urandom(1 << 20))
    before = model_fingerprint(config, [weights])
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last chunk is always sampled
    weights.write_bytes(bytes(data))
    assert model_fingerprint(config, [weights]) != before


def test_a_split_over_ranks_is_a_layout_of_its_own_and_one_process_keeps_its_key() -> None:
    """One process's key is that of the releases before sharded layouts (their directories still load); a
    split's parts size its payload, in rank order, and another split (or tp=2 against pp=2) is another key."""
    assert LAYOUT.key == "9a9eda9408c08b126cbc838185d84701"
    assert "shards" not in LAYOUT.describe() and LAYOUT.shard_bytes == [LAYOUT.block_bytes]
    tp2 = dataclasses.replace(LAYOUT, shards=(KVShard(0, 0, 2, 1), KVShard(1, 0, 2, 1)))
    pp2 = dataclasses.replace(LAYOUT, shards=(KVShard(0, 0, 1, 1), KVShard(0, 1, 1, 1)))
    uneven = dataclasses.replace(LAYOUT, shards=(KVShard(0, 0, 2, 1), KVShard(0, 1, 1, 1)))
    assert len({LAYOUT.key, tp2.key, pp2.key, uneven.key}) == 4
    assert tp2.shard_bytes == [2 * 2 * BS * 2 * 4] * 2 and pp2.block_bytes == LAYOUT.block_bytes
    assert uneven.shard_bytes == [128, 64]
    payload = bytes(range(192))
    assert [bytes(p) for p in split_payload(payload, uneven.shard_bytes)] == [payload[:128], payload[128:]]
    with pytest.raises(ValueError, match="not its ranks' parts"):
        split_payload(payload[:-1], uneven.shard_bytes)


def test_restored_blocks_whose_kv_did_not_load_are_evicted_again() -> None:
    """``evict_restored_blocks`` undoes a restore: the blocks are free, their hashes hit nothing; a referenced
    block is refused."""
    origins = tracked(4)
    kv = origins.kv
    first = origins.restore_cached_block(b"\1" * 16, BlockOrigin(None, (1,) * BS, None))
    second = origins.restore_cached_block(b"\2" * 16, BlockOrigin(b"\1" * 16, (2,) * BS, None))
    assert first is not None and second is not None and kv.block_pool.num_cached_blocks == 2
    kv.evict_restored_blocks([first, second])
    kv.check_integrity()
    assert kv.block_pool.num_cached_blocks == 0 and kv.block_pool.get_cached_block(b"\1" * 16) is None
    assert kv.num_free_blocks == kv.num_blocks
    table = admit(kv, "x", list(range(BS)))
    with pytest.raises(ValueError, match="not an unreferenced cached block"):
        kv.evict_restored_blocks(table)
